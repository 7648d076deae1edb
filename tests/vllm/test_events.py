"""KV events for a router (connector.events), under vLLM 0.33's real scheduler with a real
kvstore-server, published by vLLM's own ZmqEventPublisher: a subscriber written to vLLM's
KVEventBatch msgpack schema (ZMQ SUB plus the replay socket) sees BlockStored with the
store's medium for the pages saved, carrying the very block hashes vLLM announces for its
GPU blocks, then BlockRemoved after an eviction and after an invalidation, in order; and a
subscriber that reconnects replays what it missed with no gap in the sequence."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (scripts/venv-vllm.sh)")
msgspec = pytest.importorskip("msgspec")    # vLLM's; not in the main test venv
zmq = pytest.importorskip("zmq")

from harness import (  # noqa: E402
    ConnectorSpec,
    ModelShape,
    SchedulerDriver,
    WorkerDriver,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from vllm.config.kv_events import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvstore_client import KVStoreClient  # noqa: E402
from kvstore_testing.serverproc import free_port  # noqa: E402

SHAPE = ModelShape()
FIRST = list(range(7000, 7064))      # 64 tokens: 4 pages saved
SECOND = list(range(8000, 8048))     # 48 tokens: 3 pages
MEDIUM = "KVSTORE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """A router's side of one engine's stream: SUB for live batches, the replay socket
    (a DEALER to vLLM's ROUTER) for what it missed; decodes vLLM's KVEventBatch."""

    def __init__(self, pub: str, replay: str) -> None:
        self.ctx = zmq.Context.instance()
        self.pub, self.replay = pub, replay
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}
        self.sub = None
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.pub)

    def disconnect(self) -> None:
        self.sub.close(linger=0)
        self.sub = None

    def drain(self) -> None:
        while self.sub is not None and self.sub.poll(0):
            _topic, seq, payload = self.sub.recv_multipart()
            self.batches[int.from_bytes(seq, "big")] = self.decoder.decode(payload)

    def replay_from(self, start: int) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay)
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        try:
            while True:
                assert sock.poll(10_000), "no replay answer"
                _empty, _topic, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    return
                self.batches[int.from_bytes(seq, "big")] = self.decoder.decode(payload)
        finally:
            sock.close(linger=0)

    def events(self, medium: str | None = MEDIUM):
        """(seq, event) in order, of one medium (None: all)."""
        return [(seq, ev) for seq in sorted(self.batches) for ev in self.batches[seq].events
                if medium is None or getattr(ev, "medium", medium) == medium]

    def close(self) -> None:
        if self.sub is not None:
            self.disconnect()


def engine(model_dir, srv, port):
    spec = ConnectorSpec(name="KVStoreConnector", module_path="kvstore_connector.vllm",
                         extra_config={"server": srv.address, "load_mode": "async",
                                       "lookup_timeout": 5.0, "lookup_wait_ms": 5000,
                                       "model_revision": "r1", "events_interval": 0.1},
                         load_failure_policy="recompute")
    config = make_vllm_config(model_dir, spec)
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{port + 1}", buffer_steps=1000)
    kv_cache_config = make_kv_cache_config(config)
    return SchedulerDriver(make_scheduler(config, kv_cache_config),
                           WorkerDriver(config, kv_cache_config, SHAPE))


def serve(driver, req_id, prompt, max_steps=200):
    """Run a request to its end; vLLM's block hashes of its prompt."""
    driver.add(make_request(req_id, prompt, max_tokens=2))
    hashes = None
    for _ in range(max_steps):
        if req_id not in driver.scheduler.requests:
            return hashes
        hashes = list(driver.request(req_id).block_hashes)
        driver.step()
        time.sleep(0.01)
    raise AssertionError(f"{req_id} did not finish")


def step_until(driver, sub, pred, timeout=20.0):
    """Step the engine (each step publishes what take_events gave) until pred(sub)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        driver.step()
        time.sleep(0.02)
        sub.drain()
        if pred(sub):
            return
    raise AssertionError(f"not seen in {timeout}s: {sub.events()}")


def stored(sub):
    return [ev for _, ev in sub.events() if isinstance(ev, BlockStored)]


def removed(sub):
    return [h for _, ev in sub.events() if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


@pytest.fixture
def stream(model_dir, fresh_server):
    srv = fresh_server(dram="64MiB")
    port = free_port()
    driver = engine(model_dir, srv, port)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    time.sleep(0.3)                         # a SUB joins late: let it join first
    yield srv, driver, sub
    sub.close()
    driver.scheduler.shutdown()


def test_saved_pages_are_announced_then_removed_after_eviction_and_invalidation(stream):
    srv, driver, sub = stream
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as export
    first = [export(h) for h in serve(driver, "first", FIRST)]
    step_until(driver, sub, lambda s: len([h for ev in stored(s) for h in ev.block_hashes]) >= 4)
    ours = stored(sub)
    assert [h for ev in ours for h in ev.block_hashes] == first[:4]
    assert ours[0].parent_block_hash is None and ours[0].token_ids == FIRST
    assert ours[0].block_size == 16 and ours[0].group_idx == 0
    # The very hashes vLLM announced for the same blocks on the GPU: one router key.
    gpu = [h for _, ev in sub.events(None)
           if isinstance(ev, BlockStored) and ev.medium == "GPU" for h in ev.block_hashes]
    assert set(first[:4]) <= set(gpu)

    # Evicted from the store's DRAM (no tier below): removed.
    layouts = [s for s in KVStoreClient(srv.address).list_layouts() if s.pages]
    with KVStoreClient(srv.address) as admin:
        admin.admin.evict(layout_id=layouts[0].layout.layout_id)
    step_until(driver, sub, lambda s: set(first[:4]) <= set(removed(s)))

    # Saved again (a recompute), then the layout invalidated: removed again, in order.
    serve(driver, "first-again", FIRST)
    second = [export(h) for h in serve(driver, "second", SECOND)]
    step_until(driver, sub, lambda s: len(stored(s)) >= 3)
    with KVStoreClient(srv.address) as admin:
        admin.admin.invalidate(model=layouts[0].layout.model)
    step_until(driver, sub, lambda s: set(second[:3]) <= set(removed(s)))

    ordered = [(type(ev).__name__, tuple(getattr(ev, "block_hashes", ())))
               for _, ev in sub.events()]
    kinds = [k for k, _ in ordered]
    assert kinds == ["BlockStored", "BlockRemoved", "BlockStored", "BlockStored",
                     "BlockRemoved"]
    assert set(ordered[4][1]) == set(first[:4]) | set(second[:3])
    assert not any(isinstance(ev, AllBlocksCleared) for _, ev in sub.events(None))
    seqs = sorted(sub.batches)
    assert seqs == list(range(seqs[0], seqs[-1] + 1))


def test_a_subscriber_that_reconnects_replays_without_a_gap(stream):
    srv, driver, sub = stream
    serve(driver, "first", FIRST)
    step_until(driver, sub, lambda s: len(stored(s)) >= 1)
    last = max(sub.batches)
    sub.disconnect()                        # the router goes away ...
    serve(driver, "second", SECOND)         # ... while the engine goes on publishing
    for _ in range(30):
        driver.step()
        time.sleep(0.02)
    with KVStoreClient(srv.address) as c:
        c.admin.evict(everything=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not driver.connector.events.counts.removed:
        driver.step()
        time.sleep(0.05)
    for _ in range(5):
        driver.step()
    sub.connect()                           # ... and comes back: replay from where it was
    sub.replay_from(last + 1)
    time.sleep(0.2)
    sub.drain()
    seqs = sorted(sub.batches)
    assert seqs == list(range(seqs[0], seqs[-1] + 1))      # no gap
    assert len(stored(sub)) == 2 and removed(sub)


def test_a_hybrid_models_pages_are_announced_for_its_full_attention_groups(tmp_path,
                                                                            fresh_server):
    """Full + sliding-window layers (vLLM's hybrid KV cache manager on): the store's pages
    are announced once for each full-attention group (what a hit needs), with the hashes
    vLLM gives the request's blocks, and none for the sliding groups."""
    from hybrid import HybridModel, HybridShape, HybridWorker, build_hybrid
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as export
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    shape = HybridShape(("full", "sliding", "full", "sliding"), window=40)
    srv = fresh_server(dram="64MiB")
    port = free_port()
    spec = ConnectorSpec(name="KVStoreConnector", module_path="kvstore_connector.vllm",
                         extra_config={"server": srv.address, "lookup_timeout": 5.0,
                                       "lookup_wait_ms": 5000, "model_revision": "r1",
                                       "events_interval": 0.1},
                         load_failure_policy="recompute")
    config, kv_cache_config = build_hybrid(tmp_path, shape, spec)
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{port + 1}", buffer_steps=1000)
    driver = SchedulerDriver(make_scheduler(config, kv_cache_config), HybridWorker(
        config, kv_cache_config, shape, HybridModel({"h": FIRST}, shape)))
    sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    try:
        time.sleep(0.3)
        full = {i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                if not isinstance(g.kv_cache_spec, SlidingWindowSpec)}
        assert 0 < len(full) < len(kv_cache_config.kv_cache_groups)
        hashes = [export(h) for h in serve(driver, "h", FIRST)]
        step_until(driver, sub, lambda s: {ev.group_idx for ev in stored(s)} == full)
        for group in full:
            got = [h for ev in stored(sub) if ev.group_idx == group for h in ev.block_hashes]
            assert got == hashes[:len(got)] and got
        assert not driver.scheduler.connector.events.counts.failed
    finally:
        sub.close()
        driver.scheduler.shutdown()


def test_a_salted_requests_pages_carry_vllms_extra_keys(stream):
    """A request with a cache salt (its block hashes cover the salt): the store's
    BlockStored carries the same extra_keys vLLM's own BlockStored gives those blocks
    (the salt on the first block, none on the rest); an unsalted request's carry none."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        maybe_convert_block_hash as export,
    )
    from vllm.v1.request import Request

    _, driver, sub = stream
    plain = make_request("plain", SECOND, max_tokens=2)      # seeds vLLM's hasher too
    salted = Request(request_id="salted", prompt_token_ids=list(FIRST),
                     sampling_params=plain.sampling_params, pooling_params=None,
                     block_hasher=get_request_block_hasher(16, sha256), cache_salt="tenant-7")
    hashes = [export(h) for h in salted.block_hashes]
    for request in (salted, plain):
        driver.add(request)
        for _ in range(200):
            if request.request_id not in driver.scheduler.requests:
                break
            driver.step()
            time.sleep(0.01)
    step_until(driver, sub, lambda s: len([h for ev in stored(s) for h in ev.block_hashes])
               >= 4 + 3)
    ours = {h: keys for ev in stored(sub)
            for h, keys in zip(ev.block_hashes, ev.extra_keys or [None] * len(ev.block_hashes))}
    gpu = {h: keys for _, ev in sub.events(None)
           if isinstance(ev, BlockStored) and ev.medium == "GPU"
           for h, keys in zip(ev.block_hashes, ev.extra_keys or [None] * len(ev.block_hashes))}
    assert [ours[h] for h in hashes[:4]] == [gpu[h] for h in hashes[:4]]
    assert ours[hashes[0]] == ("tenant-7",) and ours[hashes[1]] is None
    assert all(ev.extra_keys is None for ev in stored(sub) if ev.block_hashes[0] not in hashes)
