"""The connector's scheduler and worker halves with CPU tensors against a real server:
the whole protocol an engine drives, without an engine. Steps that need only the store's
answers run over an in-process store instead: tests/unit/test_connector_fake.py."""

import dataclasses
import os
import signal
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore_client import KVStoreClient, PageLayout  # noqa: E402
from kvstore_connector.config import (  # noqa: E402
    ConnectorConfig,
    LoadMode,
    LookupMode,
    Role,
)
from kvstore_connector.scheduler import SchedulerHalf  # noqa: E402
from kvstore_connector.scheduler.hashing import page_keys  # noqa: E402
from kvstore_connector.worker import WorkerHalf  # noqa: E402
from kvstore_testing.serverproc import ServerProcess, sigstop  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 3, 64, 16, 2, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def layout(page_tokens=BLOCK, **kw):
    return PageLayout(model="toy", num_layers=LAYERS, page_tokens=page_tokens,
                      num_kv_heads=HEADS, head_size=HEAD, dtype="float32", **kw)


def kv_value(layer, positions, tokens):
    """Deterministic KV of a token: equal prefixes get equal KV (a stand-in model)."""
    base = (layer + 1) * 1e5 + positions * 10.0 + (tokens % 7)
    grid = torch.arange(2 * HEADS * HEAD, dtype=torch.float32).view(2, 1, HEADS, HEAD) / 1e3
    return base.view(1, -1, 1, 1) + grid          # [2, n, H, D]


class Engine:
    """Paged caches in the FlashAttention layout and a block allocator."""

    def __init__(self, server, role=Role.BOTH, page_tokens=BLOCK, mode=LoadMode.LAYERWISE,
                 lag=1, client=None, **config):
        """client: both halves' (kvstore_testing.fakeclient in unit tests); None = each
        half opens its own to server."""
        # A generous lookup timeout: a loaded CI machine must not turn hits into "ask again".
        config.setdefault("lookup_timeout", 5.0)
        # These tests call hit() as the engine would and act on its answer at once: the
        # lookups on this thread (prefetched ones: tests/integration/test_prefetch.py).
        config.setdefault("lookups", LookupMode.SYNC)
        self.config = ConnectorConfig(server=server, role=role, load_mode=mode, **config)
        self.layout = layout(page_tokens)
        self.caches = {n: torch.full((2, BLOCKS, BLOCK, HEADS, HEAD), -1.0) for n in NAMES}
        self.sched = SchedulerHalf(self.config, [self.layout], BLOCK, lag=lag, client=client)
        self.worker = WorkerHalf(self.config, self.layout, self.caches, client=client)
        self.free = list(range(BLOCKS))[::-1]

    def alloc(self, tokens):
        return [self.free.pop() for _ in range(-(-tokens // BLOCK))]

    def step(self, writes):
        """One engine step: writes = [(block_ids, tokens, start, stop)] of computed tokens."""
        return self.run(self.sched.build(), writes)

    def run(self, meta, writes):
        """The worker's part of a step planned earlier (async scheduling plans ahead)."""
        self.worker.bind(meta)
        self.worker.start_load(meta)
        for layer, name in enumerate(NAMES):
            self.worker.wait_for_layer(name)
            for block_ids, tokens, start, stop in writes:
                pos = torch.arange(start, stop)
                kv = kv_value(layer, pos, torch.as_tensor(tokens[start:stop]))
                blocks = torch.as_tensor(block_ids)[pos // BLOCK]
                self.caches[name][:, blocks, pos % BLOCK] = kv
            self.worker.save_layer(name)
        self.worker.wait_for_save()
        return meta, self.worker.finished(), self.worker.load_errors()

    def run_prompt(self, req_id, tokens, local=0, local_blocks=()):
        """Lookup, allocate, load and compute one prompt; returns (hit tokens, blocks)."""
        hit = self.sched.hit(req_id, tokens, local)
        blocks = list(local_blocks) + self.alloc(len(tokens) - local)
        self.sched.allocated(req_id, blocks, hit)
        self.sched.scheduled(req_id, tokens, local + hit, len(tokens) - local - hit,
                             block_ids=blocks)
        meta, _done, errors = self.step([(blocks, tokens, local + hit, len(tokens))])
        return hit, blocks, meta, errors

    def expect_kv(self, blocks, tokens, upto):
        for layer, name in enumerate(NAMES):
            pos = torch.arange(upto)
            got = self.caches[name][:, torch.as_tensor(blocks)[pos // BLOCK], pos % BLOCK]
            want = kv_value(layer, pos, torch.as_tensor(tokens[:upto]))
            assert torch.equal(got, want), f"layer {layer} differs"

    def close(self):
        self.worker.close()
        self.sched.close()


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 32000, n).astype(np.int32)


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="64MiB", lease_ttl="2s")


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "grpc"])
def test_full_partial_and_no_hit(srv, shm):
    a = Engine(srv.address, shared_memory=shm)
    tokens = prompt(100, 1)
    hit, _, meta, _ = a.run_prompt("a", tokens)
    assert hit == 0 and len(meta.saves) == 1 and len(meta.saves[0].keys) == 6
    # Same prompt on a second engine: every full page but never the last token.
    b = Engine(srv.address, shared_memory=shm)
    hit, blocks, meta, errors = b.run_prompt("b", tokens)
    assert hit == 96 and not errors and len(meta.loads[0].keys) == 6
    b.expect_kv(blocks, tokens, 100)
    # Shares 40 tokens: two whole pages.
    other = np.concatenate([tokens[:40], prompt(60, 2)])
    hit, blocks, _, _ = b.run_prompt("c", other)
    assert hit == 32
    b.expect_kv(blocks, other, 100)
    # Nothing shared.
    hit, _, _, _ = b.run_prompt("d", prompt(50, 3))
    assert hit == 0
    for e in (a, b):
        e.close()


def test_async_load_reports_when_done_and_abort_releases(srv):
    a = Engine(srv.address)
    tokens = prompt(64, 11)
    a.run_prompt("a", tokens)
    b = Engine(srv.address, mode=LoadMode.ASYNC)
    hit = b.sched.hit("b", tokens, 0)
    blocks = b.alloc(64)
    b.sched.allocated("b", blocks, hit)
    meta, done, errors = b.step([])
    assert meta.loads[0].is_async and not errors
    if "b" not in done:
        wait_for(lambda: "b" in b.worker.finished(), "the async load reported", timeout=5,
                 interval=0.001)
    b.sched.load_finished("b")
    b.expect_kv(blocks, tokens, hit)
    # An aborted request: the scheduler drops its lease, nothing stays pinned.
    hit = b.sched.hit("gone", tokens, 0)
    assert hit == 48
    b.sched.finished("gone")
    b.sched.build()
    with KVStoreClient(srv.address) as c:
        assert c.stats().leases == 0


def test_server_down_means_no_hit(srv):
    a = Engine(srv.address)
    srv.stop()
    assert a.sched.hit("x", prompt(64, 12), 0) == 0        # a warning, not a failure
    a.sched.build()


def test_server_restart_mid_load_falls_back_to_recompute(srv):
    a = Engine(srv.address)
    tokens = prompt(64, 13)
    a.run_prompt("a", tokens[:49])                            # stores pages 0-2
    b = Engine(srv.address)
    hit = b.sched.hit("b", tokens, 0)
    assert hit == 48
    blocks = b.alloc(64)
    b.sched.allocated("b", blocks, hit)
    b.sched.scheduled("b", tokens, hit, 64 - hit, block_ids=blocks)
    srv.stop()
    again = ServerProcess(port=srv.port, dram="64MiB").start()
    try:
        meta, _, errors = b.step([(blocks, tokens, hit, 64)])
        assert errors == set(blocks[:3])                      # the engine recomputes these
        assert len(meta.saves) == 1                           # page 3 was due to be saved...
        with KVStoreClient(again.address) as c:
            assert c.stats().tiers[0].pages == 0              # ...but KV over a failed load
        assert b.sched.load_failed_blocks(errors) == ["b"]
        assert b.sched.hit("b", tokens, 0) == 0               # and is not offered it again
    finally:
        again.stop()


def test_lookup_timeout_answers_ask_again(srv):
    a = Engine(srv.address, lookup_timeout=5.0)
    assert a.sched.hit("warm", prompt(64, 13), 0) == 0    # connected, layout registered
    # Stored, so that only the server can answer (a miss would be answered on this host
    # from the presence map, kvstore_client.presence, which a stopped server leaves live
    # for a moment).
    tokens = prompt(64, 14)
    a.run_prompt("store", tokens)
    # A server that cannot answer in time (stopped, not gone: the connection stays up).
    # A tiny deadline instead is a race: a fast loopback answer can beat its timer.
    a.sched.client.timeout = 0.3
    sigstop(srv.proc.pid)
    try:
        assert a.sched.hit("t", tokens, 0) is None
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)


def test_keys_match_across_processes_and_ranks(srv):
    """Two TP ranks' layouts share keys (one Lookup answers the minimum over both)."""
    r0, r1 = layout(tp_rank=0, tp_size=2), layout(tp_rank=1, tp_size=2)
    assert r0.chain_seed == r1.chain_seed and r0.layout_id != r1.layout_id
    cfg = ConnectorConfig(server=srv.address, lookup_timeout=5.0, lookups=LookupMode.SYNC)
    sched = SchedulerHalf(cfg, [r0, r1], BLOCK)
    tokens = prompt(64, 15)
    caches = {n: torch.zeros((2, BLOCKS, BLOCK, HEADS, HEAD)) for n in NAMES}
    w0 = WorkerHalf(cfg, r0, caches)
    sched.hit("x", tokens, 0)
    sched.allocated("x", list(range(4)), 0)
    sched.scheduled("x", tokens, 0, 64, block_ids=list(range(4)))
    meta = sched.build()
    w0.bind(meta)
    for name in NAMES:
        w0.save_layer(name)
    w0.wait_for_save()                       # only rank 0 saved
    assert sched.hit("y", tokens, 0) == 0    # rank 1 lacks the pages: no hit for anyone
    w1 = WorkerHalf(cfg, r1, {n: t.clone() for n, t in caches.items()})
    w1.bind(meta)
    for name in NAMES:
        w1.save_layer(name)
    w1.wait_for_save()
    assert sched.hit("y", tokens, 0) == 48
    dataclasses.replace(cfg)                 # the config is a frozen value


def stored_pages(address, lay, keys):
    """The store's bytes of each key, read by a client that attached after any restart."""
    with KVStoreClient(address) as c:
        return c.get(c.register_layout(lay), keys)


def keys_of(tokens, pages: int, lay: PageLayout) -> list[bytes]:
    """The keys of the first `pages` pages of tokens, as connector.scheduler.hashing
    derives them."""
    return page_keys(np.asarray(tokens[:pages * lay.page_tokens]), lay.page_tokens,
                     lay.chain_seed)


def expected_pages(tokens, pages, page_tokens=BLOCK):
    """What kv_value puts in each of the first `pages` pages, as the store lays them out."""
    out = []
    for p in range(pages):
        pos = torch.arange(p * page_tokens, (p + 1) * page_tokens)
        slabs = [kv_value(layer, pos, torch.as_tensor(tokens[pos])).contiguous()
                 for layer in range(LAYERS)]
        out.append(torch.cat([s.reshape(-1) for s in slabs]).numpy().view(np.uint8))
    return np.stack(out)


def restart(srv, how, tmp_path):
    if how == "sigkill":
        srv.stop(signal.SIGKILL)
    else:
        assert srv.stop(signal.SIGTERM) == 0        # the disk tier keeps every page
    srv.start()


@pytest.mark.parametrize("how", ["sigkill", "sigterm-disk"])
def test_after_a_restart_saves_and_loads_use_the_new_pool(fresh_server, tmp_path, how):
    """Every offset is used with the mapping of the server that issued it: an engine that
    mapped the pool before a restart saves into and loads from the new one."""
    srv = fresh_server(dram="64MiB", disk="64MiB", disk_dir=str(tmp_path / "disk"))
    a, b = Engine(srv.address), Engine(srv.address)
    old = prompt(64, 20)
    a.run_prompt("old", old)                            # both map the first pool
    hit, blocks, _, errors = b.run_prompt("warm", old)
    assert hit == 48 and not errors
    restart(srv, how, tmp_path)
    # A's first save after the restart: the store must hold exactly what A computed.
    new = prompt(64, 21)
    a.run_prompt("new", new)
    keys = keys_of(new, 4, a.layout)
    same = stored_pages(srv.address, a.layout, keys) == expected_pages(new, 4)
    assert same.all(axis=1).tolist() == [True] * 4, "the store holds other bytes than A computed"
    # B's first load after the restart reads the pages the new server holds.
    for tokens, req in ((new, "b-new"), (old, "b-old")):
        hit, blocks, _, errors = b.run_prompt(req, tokens)
        if how == "sigkill" and req == "b-old":
            assert hit == 0                             # gone with the DRAM pool
            continue
        assert hit == 48 and not errors, (req, hit, errors)
        b.expect_kv(blocks, tokens, 64)
    for e in (a, b):
        e.close()


def in_store(address, lay, keys):
    with KVStoreClient(address) as c:
        return c.exists(c.register_layout(lay), keys)


def test_a_request_sharing_blocks_of_a_failed_load_stores_nothing_of_that_step(srv):
    """R2 reads R1's blocks through the engine's prefix cache in the step R1 loads them;
    R1's load fails: R2's pages of that step were computed over KV that never arrived."""
    a = Engine(srv.address)
    tokens = prompt(64, 30)
    a.run_prompt("a", tokens)
    b = Engine(srv.address)
    assert b.sched.hit("r1", tokens, 0) == 48
    b1 = b.alloc(64)
    b.sched.allocated("r1", b1, 48)
    b.sched.scheduled("r1", tokens, 48, 16, block_ids=b1)
    t2 = np.concatenate([tokens[:48], prompt(40, 31)])     # shares R1's three pages
    assert b.sched.hit("r2", t2, 48) == 0                  # the engine's own hit covers them
    b2 = b1[:3] + b.alloc(40)
    b.sched.allocated("r2", b2, 0)
    b.sched.scheduled("r2", t2, 48, 40, block_ids=b2)
    srv.stop(signal.SIGKILL)                               # the pages are gone
    srv.start()
    _, _, errors = b.step([(b1, tokens, 48, 64), (b2, t2, 48, 88)])
    assert errors == set(b1[:3])
    r2_keys = keys_of(t2, 5, b.layout)[3:]
    assert in_store(srv.address, b.layout, r2_keys) == [False, False]
    assert b.sched.load_failed_blocks(errors) == ["r1"]
    # R2 saves nothing more, whatever restart point the engine picks for it.
    b.sched.scheduled("r2", t2, 0, 88, block_ids=b2)
    assert not b.sched.build().saves
    b.close()


def test_async_scheduling_next_chunk_of_a_failed_load_is_not_stored(srv):
    """Under AsyncScheduler step N+1 is planned before step N's load is known to have
    failed: the failed request's next chunk must not reach the store, and what it then
    recomputes must."""
    a = Engine(srv.address)
    tokens = prompt(96, 32)
    a.run_prompt("a", tokens[:64])                         # the store holds pages 0-3
    b = Engine(srv.address, lag=2)
    assert b.sched.hit("r", tokens, 0) == 64
    blocks = b.alloc(96)
    b.sched.allocated("r", blocks, 64)
    b.sched.scheduled("r", tokens, 64, 16, block_ids=blocks)     # chunk 1: 64-79
    step_n = b.sched.build()
    b.sched.scheduled("r", tokens, 80, 16, block_ids=blocks)     # chunk 2: 80-95
    step_n1 = b.sched.build()
    assert step_n1.saves[0].after == (step_n.loads[0].load_id,)
    srv.stop(signal.SIGKILL)
    srv.start()
    _, _, errors = b.run(step_n, [(blocks, tokens, 64, 80)])
    assert errors == set(blocks[:4])
    b.run(step_n1, [(blocks, tokens, 80, 96)])
    keys = keys_of(tokens, 6, b.layout)
    assert in_store(srv.address, b.layout, keys) == [False] * 6
    # The engine hears of the failure and recomputes the request from page 0: now every
    # page it computes is stored, byte-exact.
    assert b.sched.load_failed_blocks(errors) == ["r"]
    b.sched.scheduled("r", tokens, 0, 96, block_ids=blocks)
    b.step([(blocks, tokens, 0, 96)])
    same = stored_pages(srv.address, b.layout, keys) == expected_pages(tokens, 6)
    assert same.all(axis=1).tolist() == [True] * 6
    b.close()


def test_a_hung_store_costs_one_timeout_then_no_hits_until_a_probe_answers(srv):
    a = Engine(srv.address, lookup_timeout=0.3, probe_interval=1.0)
    tokens = prompt(64, 34)
    a.run_prompt("a", tokens)
    sigstop(srv.proc.pid)
    try:
        start = time.monotonic()
        answers = [a.sched.hit(f"r{i}", tokens, 0) for i in range(5)]
        first = time.monotonic() - start
        assert answers == [None, 0, 0, 0, 0]
        assert first < 0.3 * 2 + 0.5, first                # one timed-out lookup, no more
        # The request that heard "ask again" is not held back: no hit, at once.
        start = time.monotonic()
        assert [a.sched.hit("r0", tokens, 0) for _ in range(5)] == [0] * 5
        a.sched.build()
        assert time.monotonic() - start < 0.1
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    # The breaker's probe, on its own thread every probe_interval, finds it answering.
    wait_for(lambda: not a.sched.breaker.open, "the breaker's probe to close it", timeout=5,
             interval=0.05)
    assert a.sched.hit("late", tokens, 0) == 48
    a.close()


def test_lease_is_held_until_the_step_that_loads_has_come_back(srv):
    """Under async scheduling the next step is planned before the worker has pinned the
    pages of this one: an evict in that window must not take them."""
    a = Engine(srv.address)
    tokens = prompt(64, 35)
    a.run_prompt("a", tokens)
    b = Engine(srv.address, lag=2)
    assert b.sched.hit("r", tokens, 0) == 48
    blocks = b.alloc(64)
    b.sched.allocated("r", blocks, 48)
    b.sched.scheduled("r", tokens, 48, 16, block_ids=blocks)
    step_n = b.sched.build()
    b.sched.build()                                        # step N+1 planned
    with KVStoreClient(srv.address) as c:
        c.evict(everything=True, tier="all")
        assert c.stats().leases == 1                       # the lookup lease still holds
    _, _, errors = b.run(step_n, [(blocks, tokens, 48, 64)])
    assert not errors
    b.expect_kv(blocks, tokens, 64)
    b.sched.build()                                        # step N's outcome is back
    with KVStoreClient(srv.address) as c:
        assert wait_leases_gone(c)
    b.close()


def wait_leases_gone(client, timeout=5.0):
    return wait_for(lambda: not client.stats().leases, "no lease in the server",
                    timeout=timeout, interval=0.05)


class _FailedCopy:
    """A load whose copies fail on the device."""

    def wait_layer(self, layer):
        pass

    def synchronize(self):
        from connector.transfer import TransferError
        raise TransferError("injected: the copy failed on the device")


def test_a_load_failing_on_one_rank_keeps_every_rank_from_storing_over_it(srv):
    """With tensor parallelism every rank's KV after the first layer depends on every
    rank's attention: when rank 0's load fails, rank 1's pages of that step are wrong too,
    though rank 1's own load succeeded. Rank 1 hears of it from the scheduler half."""
    r0, r1 = layout(tp_rank=0, tp_size=2), layout(tp_rank=1, tp_size=2)
    cfg = ConnectorConfig(server=srv.address, lookup_timeout=5.0, lookups=LookupMode.SYNC)
    sched = SchedulerHalf(cfg, [r0, r1], BLOCK)
    tokens = prompt(64, 36)
    fill = {n: torch.zeros((2, BLOCKS, BLOCK, HEADS, HEAD)) for n in NAMES}
    for layer, name in enumerate(NAMES):
        pos = torch.arange(64)
        fill[name][:, pos // BLOCK, pos % BLOCK] = kv_value(layer, pos, torch.as_tensor(tokens))
    with KVStoreClient(srv.address) as c:                  # both ranks hold pages 0-2
        for lay in (r0, r1):
            ns = c.register_layout(lay)
            keys = keys_of(tokens, 3, r0)
            c.put(ns, keys, expected_pages(tokens, 3))
    ranks = [WorkerHalf(cfg, lay, {n: torch.full_like(t, -1.0) for n, t in fill.items()})
             for lay in (r0, r1)]
    ranks[0].transfer.load = lambda *args: _FailedCopy()
    assert sched.hit("r", tokens, 0) == 48
    blocks = list(range(4))
    sched.allocated("r", blocks, 48)
    sched.scheduled("r", tokens, 48, 16, block_ids=blocks)
    meta = sched.build()
    errors = set()
    for w in ranks:
        w.bind(meta)
        w.start_load(meta)
        for layer, name in enumerate(NAMES):
            w.wait_for_layer(name)
            pos = torch.arange(48, 64)
            w.transfer.layers[layer][:, pos // BLOCK, pos % BLOCK] = \
                kv_value(layer, pos, torch.as_tensor(tokens[48:]))
            w.save_layer(name)
        w.wait_for_save()
        w.finished()
        errors |= w.load_errors()
    assert errors == {0, 1, 2}                              # only rank 0 failed
    page3 = keys_of(tokens, 4, r0)[3:]
    assert in_store(srv.address, r1, page3) == [False]     # rank 1 holds its commit
    assert sched.load_failed_blocks(errors) == ["r"]
    meta = sched.build()
    assert meta.loads_failed == (1,)
    ranks[1].bind(meta)
    assert in_store(srv.address, r1, page3) == [False]     # ... and drops it
    with KVStoreClient(srv.address) as c:
        assert wait_leases_gone(c)
    for w in ranks:
        w.close()
    sched.close()

