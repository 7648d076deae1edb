"""The floor under hits, per tier (ConnectorConfig.min_hit_tokens, remote_min_hit_tokens),
against a real server: a request that cannot reach it is neither looked up nor, while it
is shorter, saved; the step that takes it past the floor saves every page so far."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.config import ConnectorConfig, min_hit_tokens, remote_store
from kvstore_connector.groups import CacheGroup, GroupKind
from kvstore_connector.scheduler import SchedulerHalf
from kvstore_connector.scheduler.hashing import page_keys

LAYOUT = PageLayout(model="min-hit-test", dtype="bfloat16", num_layers=2, page_tokens=16,
                    num_kv_heads=1, head_size=16)


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="32MiB", lease_ttl="30s")


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, n).astype(np.int32)


def store(srv, tokens: np.ndarray) -> None:
    keys = page_keys(tokens[:len(tokens) // 16 * 16], 16, LAYOUT.chain_seed)
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, keys, np.zeros((len(keys), ns.page_bytes), np.uint8))


def answer(sched: SchedulerHalf, req_id: str, tokens) -> int:
    for _ in range(100):
        got = sched.hit(req_id, tokens, 0)
        if got is not None:
            return got
        sched.build()
        time.sleep(0.01)
    raise AssertionError(f"{req_id}: no answer after 100 asks")


def test_the_tier_picks_the_floor():
    local = ConnectorConfig(server="127.0.0.1:5", min_hit_tokens=256,
                            remote_min_hit_tokens=2048)
    assert not remote_store(local) and min_hit_tokens(local) == 256
    for server in ("localhost:5", "[::1]:5", "unix:/run/kvstore.sock"):
        assert min_hit_tokens(ConnectorConfig(server=server, min_hit_tokens=256,
                                              remote_min_hit_tokens=2048)) == 256
    for config in (ConnectorConfig(server="10.0.0.7:5", remote_min_hit_tokens=2048),
                   ConnectorConfig(server="127.0.0.1:5", shared_memory=False,
                                   remote_min_hit_tokens=2048)):
        assert remote_store(config) and min_hit_tokens(config) == 2048
    with pytest.raises(ValueError, match="remote_min_hit_tokens"):
        ConnectorConfig.from_mapping({"remote_min_hit_tokens": -1})


def test_a_request_that_cannot_reach_the_floor_is_not_looked_up(srv):
    short, long_ = prompt(200, 1), prompt(300, 2)
    store(srv, short)
    store(srv, long_)
    sched = SchedulerHalf(ConnectorConfig(server=srv.address, lookup_timeout=5.0,
                                          lookup_wait_ms=0, min_hit_tokens=256), [LAYOUT], 16)
    try:
        assert answer(sched, "short", short) == 0         # 192 tokens stored: below 256
        assert sched.prefetch.looked_up == 0
        assert answer(sched, "long", long_) == 288
        assert sched.prefetch.looked_up == 1
    finally:
        sched.close()


def test_saves_wait_until_the_request_reaches_the_floor(srv):
    tokens = prompt(400, 3)
    sched = SchedulerHalf(ConnectorConfig(server=srv.address, lookup_timeout=5.0,
                                          min_hit_tokens=256), [LAYOUT], 16)
    try:
        blocks = list(range(1, 26))
        sched.scheduled("r", tokens, 0, 200, blocks)      # 12 full pages: 192 < 256
        assert sched.build().saves == ()
        sched.scheduled("r", tokens, 200, 100)            # 18 full pages: 288 >= 256
        (save,) = sched.build().saves
        assert save.keys == tuple(page_keys(tokens[:288], 16, LAYOUT.chain_seed))
        assert save.block_ids.reshape(-1).tolist() == blocks[:18]
    finally:
        sched.close()


def test_a_sliding_window_model_saves_every_page_as_it_fills(srv):
    # vLLM frees a sliding group's blocks behind the window: deferred, they could never
    # be saved, so a hybrid model saves as before.
    groups = [CacheGroup(0, GroupKind.FULL, ("a",), 1, 16, "bfloat16", False),
              CacheGroup(1, GroupKind.SLIDING, ("b",), 1, 16, "bfloat16", False, reach=63)]
    tokens = prompt(200, 4)
    sched = SchedulerHalf(ConnectorConfig(server=srv.address, lookup_timeout=5.0,
                                          min_hit_tokens=256), [LAYOUT, LAYOUT], 16,
                          groups=groups)
    try:
        sched.scheduled("r", tokens, 0, 200, [list(range(1, 14)), list(range(20, 33))])
        (save,) = sched.build().saves
        assert len(save.keys) == 12
    finally:
        sched.close()
