"""A hybrid model's worker (connector.worker.groupworkers) on CUDA: a full + sliding-window model
(and an MLA + sliding-window one) loads from a real server into CUDA paged buffers, over
the shared pool and without it. Every loaded block is compared byte for byte with the
page the store holds; a sliding group's blocks outside the window at the load's end, and
the engine's null block, are never written. Run on the GPU machine."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.groups import NULL_BLOCK, CacheGroup, GroupKind
from kvstore_connector.meta import LoadSpec, StepMeta
from kvstore_connector.worker import SharedStore, WorkerHalf
from kvstore_connector.worker.groupworkers import GroupWorkers

pytestmark = pytest.mark.gpu

BLOCK = 16                     # tokens a block and a page
PAGES = 10                     # pages of each request's prefix
WINDOW = 40                    # the sliding layers' window (tokens)
SENTINEL = -7.0                # what every block holds before the load
# Layers in model order: full, sliding, full, sliding (as Gemma 3 interleaves them).
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]

# (kv_factor, kv heads, head size, mla)
SHAPES = {"full+sliding": (2, 4, 32, False), "mla+sliding": (1, 1, 64, True)}


class HybridRig:
    """Two groups' pages in the store under the same keys, and the CUDA caches a hybrid
    engine loads them into (block ids of each group scrambled, none shared, none 0)."""

    def __init__(self, address: str, shape: str, seed: int) -> None:
        kv, heads, head, mla = SHAPES[shape]
        self.shape = (kv, 4 * PAGES + 8, BLOCK, heads, head)
        self.groups = [
            CacheGroup(0, GroupKind.FULL, (NAMES[0], NAMES[2]), heads, head, "bfloat16", mla,
                       0, f"g0:full:{shape}"),
            CacheGroup(1, GroupKind.SLIDING, (NAMES[1], NAMES[3]), heads, head, "bfloat16",
                       mla, WINDOW - 1, f"g1:sliding:{shape}"),
        ]
        self.layouts = [PageLayout(model=f"gpu-hybrid-{seed}", num_layers=2, page_tokens=BLOCK,
                                   num_kv_heads=heads, head_size=head, dtype="bfloat16",
                                   kv_factor=kv, salt=f"#{g.scope}") for g in self.groups]
        rng = np.random.default_rng(seed)
        # Two requests' prefixes: "a" loads layer by layer, "b" asynchronously.
        self.keys = {r: [f"hyb-{seed}-{r}-{i}".encode().ljust(16, b".") for i in range(PAGES)]
                     for r in ("a", "b")}
        self.pages: dict[tuple[int, str], np.ndarray] = {}      # (group, req) -> pages
        with KVStoreClient(address) as c:
            for g, layout in enumerate(self.layouts):
                ns = c.register_layout(layout)
                for req, keys in self.keys.items():
                    pages = rng.integers(0, 256, (PAGES, ns.page_bytes), dtype=np.uint8)
                    c.put(ns, keys, pages)
                    self.pages[g, req] = pages
        # Per group, per request: page i -> block rows[i] (one block a page).
        self.rows: dict[tuple[int, str], np.ndarray] = {}
        for g in range(2):
            ids = rng.permutation(np.arange(1, self.shape[1]))[:2 * PAGES]
            self.rows[g, "a"] = ids[:PAGES].reshape(PAGES, 1)
            self.rows[g, "b"] = ids[PAGES:].reshape(PAGES, 1)
        # The engine's view of "b"'s sliding group: null blocks before the window (vLLM
        # holds none there); "a"'s holds real blocks everywhere, so only the connector's
        # window keeps the load off its earlier blocks.
        self.first = self.groups[1].first_page(PAGES, BLOCK)
        assert 0 < self.first < PAGES - 1                  # a window of a few pages
        self.engine_rows = dict(self.rows)
        b_sliding = self.rows[1, "b"].copy()
        b_sliding[:self.first] = NULL_BLOCK
        self.engine_rows[1, "b"] = b_sliding

    def workers(self, address: str, **config) -> GroupWorkers:
        cfg = ConnectorConfig(server=address, **config)
        shared = SharedStore.open(cfg, self.layouts[0])
        self.caches = {n: torch.full(self.shape, SENTINEL, dtype=torch.bfloat16, device="cuda")
                       for n in NAMES}
        halves = [WorkerHalf(cfg, layout, {n: self.caches[n] for n in g.layer_names},
                             shared=shared)
                  for g, layout in zip(self.groups, self.layouts)]
        return GroupWorkers(self.groups, halves, BLOCK, shared)

    def loads(self) -> tuple[LoadSpec, ...]:
        return tuple(
            LoadSpec(req, tuple(self.keys[req]), self.engine_rows[0, req].copy(), req == "b",
                     load_id=i + 1,
                     group_blocks=(self.engine_rows[0, req].copy(),
                                   self.engine_rows[1, req].copy()))
            for i, req in enumerate(("a", "b")))

    def step(self, workers: GroupWorkers) -> set[int]:
        """One step loading both requests, the hooks called as vLLM's model runner does;
        the block ids whose load failed."""
        meta = StepMeta(self.loads())
        workers.bind(meta)
        workers.start_load(meta)
        for name in NAMES:
            workers.wait_for_layer(name)
        workers.wait_for_save()
        waiting = {"b"}
        deadline = time.monotonic() + 60
        while waiting and time.monotonic() < deadline:
            waiting -= workers.finished()
            time.sleep(0.01)
        assert not waiting, "the async load was never reported"
        assert workers.failed_recving() == set()
        workers.finished()
        torch.cuda.synchronize()
        return workers.load_errors()

    def check(self) -> int:
        """Every block the step should have written holds its page's slab of its layer;
        every other block still holds the sentinel. Returns the blocks compared."""
        kv, _, _, heads, head = self.shape
        lb = self.layouts[0].layer_bytes
        compared = 0
        for g, group in enumerate(self.groups):
            first = self.first if group.kind is GroupKind.SLIDING else 0
            for layer, name in enumerate(group.layer_names):
                cache = self.caches[name].cpu()
                written = np.zeros(self.shape[1], dtype=bool)
                for req in ("a", "b"):
                    for page in range(first, PAGES):
                        block = int(self.rows[g, req][page, 0])
                        written[block] = True
                        got = cache[:, block].contiguous().view(torch.uint8).numpy()
                        want = self.pages[g, req][page, layer * lb:(layer + 1) * lb]
                        assert np.array_equal(got.reshape(-1), want), \
                            f"{name} ({group.kind.value}), request {req}, page {page}"
                        compared += 1
                untouched = cache[:, torch.as_tensor(np.flatnonzero(~written))]
                assert bool((untouched == SENTINEL).all()), \
                    f"{name} ({group.kind.value}): a block outside the load was written"
        assert lb == kv * BLOCK * heads * head * 2
        return compared


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="256MiB", lease_ttl="10s")


@pytest.mark.parametrize("path", ["pool", "remote"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_hybrid_worker_loads_every_groups_pages_and_only_the_window(srv, shape, path):
    rig = HybridRig(srv.address, shape, seed=len(shape) + len(path))
    workers = rig.workers(srv.address, shared_memory=path == "pool")
    try:
        assert rig.step(workers) == set()
        window = PAGES - rig.first
        # Both requests: every page of the full group's two layers, the window's pages
        # of the sliding group's two layers.
        assert rig.check() == 2 * 2 * (PAGES + window)
        stats = workers.take_stats()
        assert stats.pages_loaded == 2 * (PAGES + window)
        assert stats.bytes_loaded == 2 * (PAGES + window) * rig.layouts[0].page_bytes
        # One client for both groups; over the pool, its mapping registered once.
        assert len({id(w.client) for w in workers.workers}) == 1
        assert workers.shared is not None
        if path == "pool":
            assert workers.shared.client.region() is not None
            assert len(workers.shared.mappings) == 1
        else:
            assert workers.shared.client.region() is None
    finally:
        workers.close()
    assert workers.shared is not None and len(workers.shared.mappings) == 0
