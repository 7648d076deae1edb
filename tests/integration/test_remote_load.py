"""Loads without the shared pool (connector.worker.remote) against a real server: each layer
received into a ring of slabs and copied as it lands, byte for byte what the shared-pool
path loads; failures reported like any failed load, leaving no thread behind."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvstore_client.layerget as layerget  # noqa: E402
from kvstore_client import KVStoreClient, PageLayout  # noqa: E402
from kvstore_connector.config import ConnectorConfig  # noqa: E402
from kvstore_connector.meta import LoadSpec, StepMeta  # noqa: E402
from kvstore_connector.worker import WorkerHalf  # noqa: E402
from kvstore_connector.worker.remote import SLABS  # noqa: E402
from kvstore_testing.serverproc import sigstop  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

BLOCK = 16

# (kv_factor, dtype, page_tokens, kv heads, head size, layers)
SHAPES = {
    "kv2-fp32-page16": (2, "float32", 16, 2, 8, 3),
    "kv2-fp16-page32": (2, "float16", 32, 4, 16, 4),     # a page spans two blocks
    "mla-bf16-page16": (1, "bfloat16", 16, 1, 64, 5),    # one latent per token
}


class Rig:
    """One layout's pages in the store and the engine-shaped caches to load them into."""

    def __init__(self, address: str, shape: tuple, pages: int, seed: int = 0) -> None:
        kv, dtype, page_tokens, heads, head, layers = shape
        self.layout = PageLayout(model=f"remote-{seed}", num_layers=layers,
                                 page_tokens=page_tokens, num_kv_heads=heads, head_size=head,
                                 dtype=dtype, kv_factor=kv)
        self.k = page_tokens // BLOCK
        blocks = pages * self.k + 8
        self.shape = (kv, blocks, BLOCK, heads, head)
        self.dtype = getattr(torch, dtype)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.keys = [f"remote-{seed}-{i}".encode().ljust(16, b".") for i in range(pages)]
        rng = np.random.default_rng(seed)
        with KVStoreClient(address) as c:
            ns = c.register_layout(self.layout)
            self.pages = rng.integers(0, 256, (pages, ns.page_bytes), dtype=np.uint8)
            c.put(ns, self.keys, self.pages)
        # Blocks in a scrambled order, none shared: page i -> blocks[i].
        self.blocks = rng.permutation(blocks)[:pages * self.k].reshape(pages, self.k)

    def worker(self, address: str, device: str = "cpu", **config) -> WorkerHalf:
        caches = {n: torch.full(self.shape, -7, dtype=self.dtype, device=device)
                  for n in self.names}
        cfg = ConnectorConfig(server=address, **config)
        return WorkerHalf(cfg, self.layout, caches)

    def specs(self, cuts: list[int], is_async=()) -> tuple[LoadSpec, ...]:
        """Loads of the pages split at `cuts`; those numbered in is_async are async."""
        edges = [0, *cuts, len(self.keys)]
        return tuple(LoadSpec(f"r{i}", tuple(self.keys[a:b]), self.blocks[a:b].copy(),
                              i in is_async, load_id=i + 1)
                     for i, (a, b) in enumerate(itertools.pairwise(edges)))

    def step(self, worker: WorkerHalf, loads, between=None) -> set[int]:
        """One step that loads `loads`; the engine's block ids whose load failed."""
        meta = StepMeta(loads)
        worker.bind(meta)
        worker.start_load(meta)
        for layer, name in enumerate(self.names):
            worker.wait_for_layer(name)
            if between is not None:
                between(layer)
        worker.wait_for_save()
        waiting = {s.req_id for s in loads if s.is_async}

        def reported() -> bool:
            waiting.difference_update(worker.finished())
            return not waiting
        wait_for(reported, "every async load reported", timeout=30, interval=0.01)
        worker.finished()
        return worker.load_errors()

    def as_bytes(self, worker: WorkerHalf) -> list[np.ndarray]:
        return [t.contiguous().view(torch.uint8).cpu().numpy().copy()
                for t in worker.transfer.layers]

    def expected(self, worker: WorkerHalf) -> None:
        """Every page's slab of every layer is in its blocks, as the store holds it."""
        lb = self.layout.page_bytes // len(self.names)
        for layer, view in enumerate(worker.transfer.layers):
            for page, blocks in enumerate(self.blocks):
                got = view[:, torch.as_tensor(blocks)].cpu()    # [kv, k, block, heads, head]
                want = torch.from_numpy(self.pages[page, layer * lb:(layer + 1) * lb].copy())
                want = want.view(self.dtype).view(got.shape[0], self.k, *got.shape[2:])
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
                    f"layer {layer}, page {page}"


def remote_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("kvstore-remote", "kvstore-layers"))]


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="256MiB", lease_ttl="5s")


@pytest.fixture
def small_stripes(monkeypatch):
    """Stripe Gets of a few pages too: with the default 16 MiB a stripe, these loads
    would run over one connection."""
    monkeypatch.setattr(layerget, "STRIPE_MIN_BYTES", 4096)


@pytest.mark.parametrize("name", list(SHAPES))
def test_remote_loads_are_the_bytes_of_the_shared_pool_path(srv, small_stripes, name):
    rig = Rig(srv.address, SHAPES[name], pages=20, seed=len(name))
    lb = rig.layout.page_bytes // len(rig.names)
    # Slabs of 3 pages' layers: every layer of the load (20 pages) is received in 7 page
    # chunks, and the whole load is many times the ring.
    remote = rig.worker(srv.address, shared_memory=False, remote_connections=3,
                        remote_staging_bytes=SLABS * 3 * lb)
    shared = rig.worker(srv.address)
    assert shared._shared() and not remote._shared()
    loads = rig.specs([5, 12], is_async={2})              # two layer-wise, one async
    assert rig.step(remote, loads) == set()
    assert rig.step(shared, loads) == set()
    ring = remote._remote._ring
    assert ring.slab_bytes == 3 * lb and SLABS * ring.slab_bytes < rig.pages.nbytes
    for layer, (a, b) in enumerate(zip(rig.as_bytes(remote), rig.as_bytes(shared))):
        assert np.array_equal(a, b), f"layer {layer} differs from the shared-pool load"
    rig.expected(remote)
    assert remote_threads() == []
    remote.close()
    shared.close()


def test_a_large_load_is_striped_and_exact(srv):
    """Past 16 MiB a stripe, over the default connections and ring."""
    rig = Rig(srv.address, (2, "float16", 16, 8, 64, 4), pages=384, seed=7)   # 48 MiB
    remote = rig.worker(srv.address, shared_memory=False, remote_connections=3)
    striped = []
    real = layerget.LayerGet.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        striped.append(len(self._bounds) - 1)

    layerget.LayerGet.__init__ = spy
    try:
        assert rig.step(remote, rig.specs([])) == set()
    finally:
        layerget.LayerGet.__init__ = real
    assert striped == [3]
    rig.expected(remote)
    remote.close()


def test_each_layer_is_copied_by_the_stripe_that_completed_it_in_order(srv, small_stripes):
    """Striped over three connections: every layer's copy is enqueued once, in layer
    order, by a stripe's thread (kvstore-layers-*), not by the load's own thread after a
    hand-over, and the pages land exact."""
    rig = Rig(srv.address, SHAPES["kv2-fp16-page32"], pages=24, seed=9)
    remote = rig.worker(srv.address, shared_memory=False, remote_connections=3)
    real = remote.transfer.load_layer
    calls: list[tuple[int, str]] = []

    def spy(layer, slab, blocks):
        calls.append((layer, threading.current_thread().name))
        return real(layer, slab, blocks)

    remote.transfer.load_layer = spy
    assert rig.step(remote, rig.specs([])) == set()
    assert [layer for layer, _ in calls] == list(range(len(rig.names)))
    assert all(name.startswith("kvstore-layers-") for _, name in calls), calls
    rig.expected(remote)
    remote.close()


def test_layer_zero_is_ready_while_later_layers_are_still_on_the_wire(srv, small_stripes):
    """The server is stopped once layer 0's copy is enqueued: the forward's wait for
    layer 0 returns while the others cannot have arrived; they land once it resumes."""
    rig = Rig(srv.address, (2, "float32", 16, 8, 64, 16), pages=64, seed=3)   # 64 MiB
    remote = rig.worker(srv.address, shared_memory=False, remote_connections=2,
                        timeout=5.0)
    real = remote.transfer.load_layer

    def first_then_stop(layer, slab, blocks):
        event = real(layer, slab, blocks)
        if layer == 0 and not stopped.is_set():
            sigstop(srv.proc.pid)
            stopped.set()
        return event

    stopped = threading.Event()
    remote.transfer.load_layer = first_then_stop
    seen = []

    def between(layer):
        if layer == 0:
            load = remote._layer_handles[0]._load
            seen.append(load._ready)
            os.kill(srv.proc.pid, signal.SIGCONT)

    assert rig.step(remote, rig.specs([]), between) == set()
    assert seen and seen[0] < len(rig.names), seen
    rig.expected(remote)
    remote.close()


def test_a_server_killed_mid_load_fails_the_load_and_leaves_nothing(srv, small_stripes):
    # Far more than the sockets' buffers hold, so the kill cuts the stream.
    rig = Rig(srv.address, (2, "float32", 16, 8, 64, 32), pages=48, seed=5)  # 96 MiB
    remote = rig.worker(srv.address, shared_memory=False, remote_connections=4,
                        remote_staging_bytes=16 << 20)
    real = remote.transfer.load_layer

    def kill_after_first(layer, slab, blocks):
        if layer == 1 and srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
        return real(layer, slab, blocks)

    remote.transfer.load_layer = kill_after_first
    loads = rig.specs([20])
    errors = rig.step(remote, loads)
    assert errors == {int(b) for b in rig.blocks.reshape(-1)}   # the engine recomputes
    assert remote_threads() == []
    assert len(remote._remote._ring._free) == SLABS              # every slab is back
    assert remote.breaker.open                                    # as any lost call
    remote.close()
    assert remote_threads() == []


def test_a_stalled_server_fails_the_load_within_the_timeout(srv, small_stripes):
    rig = Rig(srv.address, (2, "float32", 16, 8, 64, 16), pages=48, seed=6)
    remote = rig.worker(srv.address, shared_memory=False, remote_connections=2,
                        remote_staging_bytes=16 << 20, timeout=0.5)
    real = remote.transfer.load_layer

    def stall_after_first(layer, slab, blocks):
        if layer == 1 and not stalled:
            sigstop(srv.proc.pid)
            stalled.append(True)
        return real(layer, slab, blocks)

    stalled: list = []
    remote.transfer.load_layer = stall_after_first
    start = time.monotonic()
    try:
        errors = rig.step(remote, rig.specs([]))
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert errors == {int(b) for b in rig.blocks.reshape(-1)}
    assert time.monotonic() - start < 10
    assert remote_threads() == []
    remote.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_missing_page_fails_only_the_load_it_belongs_to(srv, chunked):
    """The step's loads share one Get; a page missing fails that Get, and each load is
    then asked for alone, as the shared-pool path does with its Acquire."""
    rig = Rig(srv.address, SHAPES["kv2-fp32-page16"], pages=12, seed=9)
    lb = rig.layout.page_bytes // len(rig.names)
    staging = {"remote_staging_bytes": SLABS * 2 * lb} if chunked else {}
    remote = rig.worker(srv.address, shared_memory=False, **staging)
    with KVStoreClient(srv.address) as c:
        c.delete(c.register_layout(rig.layout), rig.keys[6:7])
    errors = rig.step(remote, rig.specs([4, 8]))        # pages 4-7 hold the missing one
    assert errors == {int(b) for b in rig.blocks[4:8].reshape(-1)}
    assert not remote.breaker.open                # a missing page is an answer
    for page in (*range(4), *range(8, 12)):       # the other loads landed, byte-exact
        for layer, view in enumerate(remote.transfer.layers):
            got = view[:, torch.as_tensor(rig.blocks[page])].contiguous().view(torch.uint8)
            want = rig.pages[page, layer * lb:(layer + 1) * lb]
            assert np.array_equal(got.numpy().reshape(-1), want), (page, layer)
    assert remote_threads() == []
    assert len(remote._remote._ring._free) == SLABS
    remote.close()


def test_the_deadline_bounds_the_wait_for_a_layer(srv):
    """A store that answers nothing (stopped) while the client's timeout is long: the
    forward's wait for a layer ends at the load's deadline, the load is stopped and
    reported failed, and its threads end."""
    rig = Rig(srv.address, SHAPES["kv2-fp32-page16"], pages=8, seed=12)
    remote = rig.worker(srv.address, shared_memory=False, timeout=60.0)
    # Registered, and the fast path open, while the store answers, as in an engine that
    # has run a while: a stop shuts the Get's socket.
    remote.client.exists(remote.ns, rig.keys[:1])
    meta = StepMeta(rig.specs([]))
    sigstop(srv.proc.pid)
    try:
        remote.bind(meta)
        remote.start_load(meta)
        load = remote._layer_handles[0]._load
        load.deadline = time.monotonic() + 0.5     # not the 60 s the settings give
        start = time.monotonic()
        remote.wait_for_layer(rig.names[0])
        waited = time.monotonic() - start
        remote.wait_for_save()
        errors = remote.load_errors()
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert 0.3 < waited < 5, waited
    assert errors == {int(b) for b in rig.blocks.reshape(-1)}
    assert remote_threads() == []
    remote.close()
