"""KVStoreHiCacheStorage when the store restarts, loses pages or hangs in the middle of
SGLang's calls: every page reported loaded holds the bytes that were stored under its key,
every other destination is left as it was, nothing wrong is stored, and a hung store
costs each of SGLang's threads one timeout, then nothing, until the breaker's probe (on
its own thread) finds it answering."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
import urllib.request

import pytest

pytest.importorskip("sglang", reason="needs SGLang 0.5.23 (scripts/venv-sglang.sh)")

from test_hicache_storage import _backend, _filled, _indices, _keys, _tokens

from kvstore_client import KVStoreClient
from kvstore_connector.sglang import Failures
from kvstore_testing.serverproc import free_port, sigstop
from tests.waiting import wait_for


def _fault(srv, how: str) -> None:
    if how == "sigkill":
        srv.stop(signal.SIGKILL)
        srv.start()
    elif how == "sigterm-disk":
        assert srv.stop(signal.SIGTERM) == 0
        srv.start()
    else:                                                       # evict everything
        with KVStoreClient(srv.address) as client:
            client.evict(everything=True, tier="all")


@pytest.mark.parametrize("how", ["sigkill", "sigterm-disk", "evict"])
def test_a_fault_between_exists_and_get_gives_misses_never_wrong_pages(fresh_server,
                                                                       tmp_path, how):
    """SGLang's prefetch asks batch_exists, then batch_get_v1 a moment later; the store
    restarts or drops the pages in between."""
    srv = fresh_server(dram="256MiB", disk="256MiB", disk_dir=str(tmp_path / "disk"))
    pool = _filled("mha", "page_first")
    writer, reader = _backend(srv, pool), _backend(srv, pool)
    keys = _keys(4)
    assert writer.batch_set_v1(keys, _indices(pool, [0, 1, 2, 3])) == [True] * 4
    assert reader.batch_exists(keys) == 4
    _fault(srv, how)
    before = [_tokens(pool, p) for p in (4, 5, 6, 7)]
    got = reader.batch_get_v1(keys, _indices(pool, [4, 5, 6, 7]))
    assert got == ([True] * 4 if how == "sigterm-disk" else [False] * 4)
    for i, loaded in enumerate(got):
        want = _tokens(pool, i) if loaded else before[i]
        assert _tokens(pool, 4 + i) == want, f"page {i}: wrong bytes in the host pool"
    # The backend keeps working against the store as it is now.
    fresh = _keys(2)
    assert writer.batch_set_v1(fresh, _indices(pool, [0, 1])) == [True, True]
    assert reader.batch_get_v1(fresh, _indices(pool, [8, 9])) == [True, True]
    assert [_tokens(pool, p) for p in (8, 9)] == [_tokens(pool, p) for p in (0, 1)]


def test_a_restart_between_reserve_and_commit_stores_nothing(fresh_server):
    """The store restarts while a backup copies pages into slots the old server reserved:
    the commit cannot land in the new one, the set reports failure, no page is stored."""
    srv = fresh_server(dram="256MiB")
    pool = _filled("mha", "layer_first")
    backend = _backend(srv, pool)
    keys = _keys(2)
    real_store_page = backend._store_page
    restarted = []

    def store_page(region, offset):
        if not restarted:                       # the first page's copy: mid-backup
            restarted.append(1)
            srv.stop(signal.SIGKILL)
            srv.start()
        return real_store_page(region, offset)

    backend._store_page = store_page
    assert backend.batch_set_v1(keys, _indices(pool, [0, 1])) == [False, False]
    backend._store_page = real_store_page
    assert restarted and backend.batch_exists(keys) == 0
    # The next backup goes into the new server's pool and reads back byte-exact.
    assert backend.batch_set_v1(keys, _indices(pool, [0, 1])) == [True, True]
    assert backend.batch_get_v1(keys, _indices(pool, [2, 3])) == [True, True]
    assert [_tokens(pool, p) for p in (2, 3)] == [_tokens(pool, p) for p in (0, 1)]


TIMEOUT, PROBE, SLACK = 0.5, 0.3, 0.2


def test_a_hung_store_costs_each_thread_one_timeout_then_nothing(fresh_server):
    """SGLang's prefetch and backup threads keep calling for 2.5 s (eight probe
    intervals) while the store is stopped: at most one call of each thread waits (up to
    `timeout`), every other call answers "miss" within SLACK -- no probe runs on them."""
    srv = fresh_server(dram="256MiB")
    pool = _filled("mha", "page_first")
    backend = _backend(srv, pool, timeout=TIMEOUT, probe_interval=PROBE)
    keys = _keys(2)
    assert backend.batch_set_v1(keys, _indices(pool, [0, 1])) == [True, True]
    costs: dict[str, list[float]] = {"prefetch": [], "backup": []}

    def prefetch():
        while time.monotonic() < stop_at:
            start = time.monotonic()
            assert backend.batch_exists(keys) in (0, 2)
            backend.batch_get_v1(keys, _indices(pool, [2, 3]))
            costs["prefetch"].append(time.monotonic() - start)
            time.sleep(0.02)

    def backup():
        while time.monotonic() < stop_at:
            start = time.monotonic()
            backend.batch_set_v1(_keys(1), _indices(pool, [4]))
            costs["backup"].append(time.monotonic() - start)
            time.sleep(0.02)

    sigstop(srv.proc.pid)
    try:
        stop_at = time.monotonic() + 2.5
        threads = [threading.Thread(target=f) for f in (prefetch, backup)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    for name, times in costs.items():
        times.sort()
        print(f"{name}: {len(times)} calls, slowest {times[-1]:.3f} s, then "
              f"{times[-2]:.3f} s, median {times[len(times) // 2] * 1e3:.2f} ms")
        assert len(times) > 20, (name, len(times))
        assert times[-1] < TIMEOUT * 2 + SLACK, (name, times[-3:])   # get: exists + get
        assert times[-2] < SLACK, (name, times[-3:])
    assert backend.breaker.probes >= 2           # probed meanwhile, off SGLang's threads
    wait_for(lambda: not backend.breaker.open, "a probe to find the store answering",
             timeout=5, interval=0.05)
    assert backend.batch_exists(keys) == 2
    assert backend.batch_get_v1(keys, _indices(pool, [2, 3])) == [True, True]
    assert [_tokens(pool, p) for p in (2, 3)] == [_tokens(pool, p) for p in (0, 1)]


def test_a_token_the_store_refuses_opens_the_breaker(fresh_server, tmp_path):
    """UNAUTHENTICATED means the store is not answering (connector.breaker.not_answering),
    as it does for the vLLM connector's halves: the first call that meets it opens the
    breaker, and SGLang's later calls are misses without a call to the store."""
    auth = tmp_path / "auth.toml"
    auth.write_text(f'[tenants.engine]\ntoken_sha256 = '
                    f'"{hashlib.sha256(b"tok-known").hexdigest()}"\n')
    port = free_port()
    srv = fresh_server(dram="256MiB", auth_file=str(auth), metrics_port=port)
    pool = _filled("mha", "page_first")
    # A long probe interval: once open, the breaker stays open for the whole test.
    backend = _backend(srv, pool, token="tok-unknown", probe_interval=60.0)
    keys = _keys(2)
    assert backend.batch_exists(keys) == 0
    first = _refused(port)
    assert first, "the store refused no call"
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, _indices(pool, [0, 1])) == [False, False]
    assert backend.batch_set_v1(keys, _indices(pool, [0, 1])) == [False, False]
    assert _refused(port) == first                      # no call after the first
    assert backend.failures == Failures(get=2, set=2, exists=2)


def _refused(port: int) -> list[str]:
    """The server's counts of calls and fast-path connections it refused as
    unauthenticated, but RegisterLayout's (the backend registers its layout at start,
    before any call of SGLang's)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return [line for line in text.decode().splitlines()
            if (line.startswith("kvstore_rpc_total") and 'code="UNAUTHENTICATED"' in line
                and 'method="RegisterLayout"' not in line)
            or line.startswith('kvstore_fast_refused_total{reason="unauthenticated"}')]
