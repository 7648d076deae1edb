"""A full + Mamba (align mode) worker on CUDA: state pages saved from vLLM 0.33's byte
views of Mamba layers ([blocks, 1, 1, content] over blocks padded apart) with no layer hook
called for them (vLLM hooks attention layers only), then loaded into other blocks of
another request, over the shared pool and without it. Every state block is compared byte
for byte; no other block, and no padding, is written. Run on the GPU machine."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.groups import NULL_BLOCK, CacheGroup, GroupKind
from kvstore_connector.meta import LoadSpec, SaveSpec, StepMeta
from kvstore_connector.scheduler.mamba import mamba_view
from kvstore_connector.worker import SharedStore, WorkerHalf
from kvstore_connector.worker.groupworkers import GroupWorkers

pytestmark = pytest.mark.gpu

BLOCK, PAGES, BLOCKS = 16, 4, 24
CONTENT, PADDED = 6912, 8192          # a state's bytes, a block's stride (vLLM pads)
FULL_NAMES = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
MAMBA_NAMES = ["model.layers.1.mixer", "model.layers.3.mixer"]


def _groups(seed: int) -> tuple[list[CacheGroup], list[PageLayout]]:
    groups = [CacheGroup(0, GroupKind.FULL, tuple(FULL_NAMES), 4, 32, "bfloat16", False,
                         scope=f"g0:full:{seed}", block_size=BLOCK),
              CacheGroup(1, GroupKind.MAMBA, tuple(MAMBA_NAMES), 1, 1, "uint8", False,
                         scope=f"g1:mamba:{seed}", block_size=BLOCK, state_bytes=CONTENT)]
    layouts = [PageLayout(model=f"gpu-mamba-{seed}", num_layers=2, page_tokens=BLOCK,
                          num_kv_heads=4, head_size=32, dtype="bfloat16",
                          salt=f"#{groups[0].scope}"),
               PageLayout(model=f"gpu-mamba-{seed}", num_layers=2, page_tokens=1,
                          num_kv_heads=1, head_size=CONTENT, dtype="uint8", kv_factor=1,
                          salt=f"#{groups[1].scope}")]
    return groups, layouts


def _mamba_cache() -> tuple[torch.Tensor, torch.Tensor]:
    """(the raw padded buffer, vLLM 0.33's byte view of it), filled with 0x5a."""
    raw = torch.full((BLOCKS * PADDED,), 0x5A, dtype=torch.int8, device="cuda")
    return raw, torch.as_strided(raw, (BLOCKS, 1, 1, CONTENT), (PADDED, CONTENT, CONTENT, 1))


def _settle(workers: GroupWorkers, req: str, *, load: bool) -> None:
    deadline = time.monotonic() + 60
    done: set[str] = set()
    while req not in done and time.monotonic() < deadline:
        done |= workers.finished() if load else workers.sent({req})
        time.sleep(0.01)
    assert req in done
    torch.cuda.synchronize()


@pytest.mark.parametrize("path", ["pool", "remote"])
def test_state_pages_saved_without_hooks_load_back_byte_for_byte(fresh_server, path):
    srv = fresh_server(dram="256MiB", lease_ttl="10s")
    seed = len(path)
    groups, layouts = _groups(seed)
    cfg = ConnectorConfig(server=srv.address, shared_memory=path == "pool")
    shared = SharedStore.open(cfg, layouts[0])
    full = {n: torch.zeros(2, BLOCKS, BLOCK, 4, 32, dtype=torch.bfloat16, device="cuda")
            for n in FULL_NAMES}
    raws, views = {}, {}
    for n in MAMBA_NAMES:
        raws[n], views[n] = _mamba_cache()
    halves = [WorkerHalf(cfg, layouts[0], full, shared=shared),
              WorkerHalf(cfg, layouts[1], {n: mamba_view(views[n], CONTENT)
                                           for n in MAMBA_NAMES}, shared=shared)]
    workers = GroupWorkers(groups, halves, BLOCK, shared)
    rng = np.random.default_rng(seed)
    keys = tuple(f"mamba-{seed}-{i}".encode().ljust(16, b".") for i in range(PAGES))
    try:
        # Step 1, request "a": a prefill whose last page's state is in block 7 (the
        # others null, as in vLLM's align mode); the model wrote it.
        state = {n: torch.as_tensor(rng.integers(-128, 128, CONTENT, dtype=np.int8)).cuda()
                 for n in MAMBA_NAMES}
        for n in MAMBA_NAMES:
            views[n][7, 0, 0] = state[n]
        full_rows = np.arange(1, PAGES + 1, dtype=np.int64).reshape(PAGES, 1)
        state_rows = np.full((PAGES, 1), NULL_BLOCK, dtype=np.int64)
        state_rows[-1] = 7
        save = SaveSpec("a", keys, full_rows, (), (full_rows, state_rows))
        meta = StepMeta(saves=(save,))
        workers.bind(meta)
        workers.start_load(meta)
        for n in FULL_NAMES:                  # vLLM hooks its attention layers only
            workers.wait_for_layer(n)
            workers.save_layer(n)
        workers.wait_for_save()
        _settle(workers, "a", load=False)
        with KVStoreClient(srv.address) as c:
            ns = c.register_layout(layouts[1])
            assert c.exists(ns, list(keys)) == [False] * (PAGES - 1) + [True]
            page = c.get(ns, [keys[-1]])[0]
        want = b"".join(state[n].cpu().numpy().tobytes() for n in MAMBA_NAMES)
        assert bytes(page) == want

        # Step 2, request "b": an async load of the same prefix, its state into block 19.
        state_rows_b = np.full((PAGES, 1), NULL_BLOCK, dtype=np.int64)
        state_rows_b[-1] = 19
        full_rows_b = full_rows + 10
        load = LoadSpec("b", keys, full_rows_b, True, load_id=1,
                        group_blocks=(full_rows_b, state_rows_b))
        meta = StepMeta(loads=(load,))
        workers.bind(meta)
        workers.start_load(meta)
        workers.wait_for_save()
        _settle(workers, "b", load=True)
        assert workers.failed_recving() == set() and workers.load_errors() == set()
        for n in MAMBA_NAMES:
            raw = raws[n].view(BLOCKS, PADDED).cpu()
            assert torch.equal(raw[19, :CONTENT].cuda(), state[n])
            assert bool((raw[19, CONTENT:] == 0x5A).all())          # the padding
            others = [b for b in range(BLOCKS) if b not in (7, 19)]
            assert bool((raw[others] == 0x5A).all())                # no other block
        stats = workers.take_stats()
        assert stats.pages_loaded == PAGES + 1
    finally:
        workers.close()
