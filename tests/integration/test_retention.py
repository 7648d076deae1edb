"""Session retention against a real server (kvstore_server.store.retention): a session's
prefix outlives another tenant's eviction pressure for its TTL and not after; the
tenant's quota is enforced (refused, counted, the call still answered); release ends
it; a client killed holding one leaves it to its TTL; a retained page can be deleted.
What the server holds is read from /metrics, as an operator reads it."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.scheduler.lookups import StoreLookups
from kvstore_connector.scheduler.quiet import StepGate
from kvstore_connector.scheduler.retention import RetainAsk, Retainer
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore_testing.serverproc import free_port
from tests.waiting import wait_for

# 256 KiB pages: the 32 MiB pool holds about 120 of them; the default retention quota
# (a tenth of the pool) about 12.
LAYOUT = PageLayout(model="retention", num_layers=4, page_tokens=16, num_kv_heads=8,
                    head_size=128)
TOKENS = {"a": "tok-retain-a", "b": "tok-retain-b", "ops": "tok-retain-ops"}
TTL = 3.0


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture
def srv(fresh_server, tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text("".join(
        f'[{"admins" if name == "ops" else "tenants"}.{name}]\n'
        f'token_sha256 = "{sha(token)}"\n\n' for name, token in TOKENS.items()))
    port = free_port()
    server = fresh_server(dram="32MiB", auth_file=str(path), metrics_port=port)
    server.metrics_port = port
    return server


def client(srv, name: str) -> KVStoreClient:
    return KVStoreClient(srv.address, token=TOKENS[name], shared_memory=False,
                         data_plane=False, retries=0)


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def pages(n: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def metric(srv, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def pressure(srv, round_: str) -> None:
    """Tenant b fills the whole pool twice over."""
    with client(srv, "b") as b:
        ns = b.register_layout(LAYOUT)
        n = 32 * (1 << 20) // ns.page_bytes
        for part in range(4):
            ks = keys(f"b{round_}{part}", n // 2)
            b.put(ns, ks, pages(len(ks), ns.page_bytes))


def stored(c: KVStoreClient, ns, ks: list[bytes]) -> int:
    return sum(c.exists(ns, ks))


def test_a_sessions_prefix_survives_pressure_for_its_ttl_and_not_after(srv):
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        kept, other = keys("kept", 8), keys("other", 8)
        a.put(ns, kept + other, pages(16, ns.page_bytes))
        got = a.retain(ns, kept, "agent-1", TTL)
        assert got.retained and got.pages == 8
        assert metric(srv, "kvstore_retained_pages") == 8
        assert metric(srv, "kvstore_retention_sessions") == 1
        pressure(srv, "1")
        assert stored(a, ns, kept) == 8
        assert stored(a, ns, other) == 0            # the pressure was real
        wait_for(lambda: metric(srv, "kvstore_retained_pages") == 0, "the TTL to lapse",
                 timeout=3 * TTL)
        assert metric(srv, "kvstore_retention_sessions") == 0
        pressure(srv, "2")
        assert stored(a, ns, kept) == 0


def test_the_quota_refuses_counts_and_still_answers(srv):
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        ks = keys("big", 20)                        # over a tenth of the pool
        a.put(ns, ks, pages(20, ns.page_bytes))
        got = a.retain(ns, ks, "greedy", TTL)
        assert not got.retained and "quota" in got.refused and got.pages == 20
        assert metric(srv, "kvstore_retention_refused_total") == 1
        assert metric(srv, "kvstore_retained_pages") == 0
        assert a.retain(ns, ks[:8], "modest", TTL).retained     # within it: kept
        assert a.lookup(ns, ks) == 20                           # the tenant is still served
        # Another tenant's quota is its own.
        with client(srv, "b") as b:
            nb = b.register_layout(LAYOUT)
            b.put(nb, ks[:8], pages(8, nb.page_bytes))
            assert b.retain(nb, ks[:8], "modest", TTL).retained
        assert metric(srv, "kvstore_retained_pages") == 16


def test_release_ends_it(srv):
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        kept = keys("rel", 8)
        a.put(ns, kept, pages(8, ns.page_bytes))
        a.retain(ns, kept, "agent-2", 600)
        with client(srv, "b") as b:                 # not another tenant's to end
            assert b.release_retention("agent-2") == 0
        assert a.release_retention("agent-2") == 8
        assert metric(srv, "kvstore_retained_pages") == 0
        pressure(srv, "3")
        assert stored(a, ns, kept) == 0


CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from kvstore_client import KVStoreClient, PageLayout
    layout = PageLayout(model="retention", num_layers=4, page_tokens=16, num_kv_heads=8,
                        head_size=128)
    c = KVStoreClient(sys.argv[1], token=sys.argv[2], shared_memory=False, data_plane=False)
    ns = c.register_layout(layout)
    ks = [f"child-{i}".encode().ljust(16, b"_") for i in range(8)]
    c.put(ns, ks, np.zeros((8, ns.page_bytes), np.uint8))
    assert c.retain(ns, ks, "engine-1", float(sys.argv[3])).retained
    print("retained", flush=True)
    time.sleep(600)
""")


def test_a_killed_clients_retention_ends_by_its_ttl(srv):
    child = subprocess.Popen([sys.executable, "-c", CHILD, srv.address, TOKENS["a"],
                              str(TTL)], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ))
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "retained"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert metric(srv, "kvstore_retained_pages") == 8
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        ks = keys("child", 8)
        pressure(srv, "4")
        assert stored(a, ns, ks) == 8               # its client is gone; its TTL is not
        wait_for(lambda: metric(srv, "kvstore_retained_pages") == 0, "the TTL to lapse",
                 timeout=3 * TTL)
        pressure(srv, "5")
        assert stored(a, ns, ks) == 0


def test_a_retained_page_can_be_deleted(srv):
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        ks = keys("gone", 8)
        a.put(ns, ks, pages(8, ns.page_bytes))
        a.retain(ns, ks, "agent-3", 600)
        assert a.delete(ns, ks[:3]) == 3
        assert a.exists(ns, ks) == [False] * 3 + [True] * 5
        assert metric(srv, "kvstore_retained_pages") == 5
        assert a.release_retention("agent-3") == 5


def test_bad_requests_get_clear_errors(srv):
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        for session, ttl, words in (("", 1.0, "session"), ("x" * 129, 1.0, "session"),
                                    ("s", 0, "ttl"), ("s", 2 * 86400, "ttl")):
            with pytest.raises(KVStoreError) as info:
                a.retain(ns, keys("k", 1), session, ttl)
            assert info.value.code.name == "INVALID_ARGUMENT" and words in info.value.message
        a.put(ns, keys("k", 1), pages(1, ns.page_bytes))
        assert a.retain(ns, keys("k", 1), "s", 1.0).retained   # the server lives on


def test_a_quota_of_zero_turns_retention_off(fresh_server):
    srv = fresh_server(dram="32MiB", retention_quota="0")
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, keys("off", 2), pages(2, ns.page_bytes))
        got = c.retain(ns, keys("off", 2), "s", TTL)
        assert not got.retained and "off" in got.refused


def test_kvstore_admin_stats_shows_it(srv):
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        ks = keys("shown", 20)
        a.put(ns, ks, pages(20, ns.page_bytes))
        a.retain(ns, ks[:8], "agent-4", 600)
        a.retain(ns, ks, "agent-5", 600)                 # over the quota: refused
    with client(srv, "ops") as ops:
        s = ops.stats()
        assert (s.retained_pages, s.retention_sessions, s.retention_refused) == (8, 1, 1)
        assert s.pinned_pages == 8 and s.leased_pages == 0
    proc = subprocess.run([sys.executable, "-m", "kvstore_client.admin_cli", "--server",
                           srv.address, "stats"], capture_output=True, text=True, timeout=60,
                          check=False, stdin=subprocess.DEVNULL,
                          env={**os.environ, "KVSTORE_TOKEN": TOKENS["ops"]})
    assert proc.returncode == 0, proc.stderr
    assert "retained 8 pages (of 1 sessions)" in proc.stdout
    assert "retains refused 1" in proc.stdout


def test_many_sessions_in_one_call_are_answered_as_retain_answers_each(srv):
    """RetainMany (what the connector sends once per engine step): per-session answers
    in order, a shared prefix sent once, the quota applied session by session."""
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        shared, own = keys("sys", 3), keys("own", 2)
        a.put(ns, shared + own, pages(5, ns.page_bytes))
        got = a.retain_many(ns, [("m1", TTL, shared + own[:1]), ("m2", TTL, shared + own[1:]),
                                 ("m3", TTL, shared + keys("absent", 1) + own),
                                 ("greedy", TTL, keys("big", 20))])
        assert [(g.pages, g.refused) for g in got[:3]] == [(4, ""), (4, ""), (3, "")]
        assert got[3].pages == 0 and got[3].retained          # nothing of it in DRAM
        assert metric(srv, "kvstore_retained_pages") == 5     # shared pages count once
        assert metric(srv, "kvstore_retention_sessions") == 4
        big = keys("big", 20)
        a.put(ns, big, pages(20, ns.page_bytes))
        over = a.retain_many(ns, [("greedy2", TTL, big), ("fine", TTL, big[:2])])
        assert "quota" in over[0].refused and over[1].retained
        assert a.release_retention("m1") == 4


def test_retain_many_is_bounded_and_checked(srv):
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        a.put(ns, keys("k", 1), pages(1, ns.page_bytes))

        def raw(**fields):
            req = pb.RetainManyRequest(layout_id=ns.layout_id,
                                       keys=pb.PackedKeys(data=b"".join(keys("k", 1)),
                                                          key_size=16), **fields)
            with pytest.raises(grpc.RpcError) as info:
                a._rpc.unary("RetainMany")(req, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return info.value.details()

        one = np.array([0], dtype="<u4").tobytes()
        assert "at most 1024" in raw(sessions=[pb.RetainSession(session=f"s{i}", ttl_ms=1000,
                                                                key_index=one)
                                               for i in range(1025)])
        assert "past the 1 keys" in raw(sessions=[pb.RetainSession(
            session="s", ttl_ms=1000, key_index=np.array([1], dtype="<u4").tobytes())])
        assert "4 bytes" in raw(sessions=[pb.RetainSession(session="s", ttl_ms=1000,
                                                           key_index=b"\0")])
        assert "ttl" in raw(sessions=[pb.RetainSession(session="s", ttl_ms=0, key_index=one)])
        assert metric(srv, "kvstore_retention_sessions") == 0   # a refused call kept nothing
        assert a.retain_many(ns, [("s", 1.0, keys("k", 1))])[0].retained


def test_a_retain_of_no_keys_moves_the_expiry_and_held_says_what_is_kept(srv):
    """What the connector sends for a session it retained before: only the pages added
    since, or none. `held` is what the session keeps after the call."""
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        ks = keys("ext", 6)
        a.put(ns, ks, pages(6, ns.page_bytes))
        assert a.retain_many(ns, [("turns", 1.0, ks[:4])])[0].held == 4
        got = a.retain_many(ns, [("turns", 60.0, []), ("unknown", 60.0, [])])
        assert [(g.pages, g.held, g.refused) for g in got] == [(0, 4, ""), (0, 0, "")]
        assert metric(srv, "kvstore_retention_sessions") == 1   # nothing made for "unknown"
        assert a.retain(ns, ks[4:], "turns", 60.0).held == 6    # the pages added since
        wait_for(lambda: metric(srv, "kvstore_retained_pages") == 6, "the added pages")
        pressure(srv, "ext")            # well past the first TTL: the extension holds
        assert stored(a, ns, ks) == 6
        a.delete(ns, ks[:1])
        assert a.retain_many(ns, [("turns", 60.0, [])])[0].held == 5


def test_the_connector_sends_a_session_only_what_it_added(srv):
    """connector.scheduler.retention.Retainer: turn after turn of one session, the keys it
    sends (spied on, the calls real) are the pages new to the store's session; a session
    the store no longer keeps (released elsewhere) gets its whole prefix at once."""
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        ks = keys("turn", 8)
        a.put(ns, ks, pages(8, ns.page_bytes))
        sent: list[list[int]] = []
        real = a.retain_many

        def spy(handle, asks):
            sent.append([len(k) for _, _, k in asks])
            return real(handle, asks)

        a.retain_many = spy
        retainer = Retainer(StoreLookups(ConnectorConfig(server=srv.address), [LAYOUT], a))
        try:
            for turn in (ks[:5], ks[:5], ks[:8]):
                retainer.submit(RetainAsk("agent", 60.0), turn)
                wait_for(retainer.idle, "the retain to be sent")
            assert sent == [[5], [0], [3]]
            assert metric(srv, "kvstore_retained_pages") == 8
            with client(srv, "a") as elsewhere:
                assert elsewhere.release_retention("agent") == 8
            retainer.submit(RetainAsk("agent", 60.0), ks)
            wait_for(retainer.idle, "the retain to be sent")
            assert sent[3:] == [[0], [8]]           # held 0 < 8: the prefix again
            assert metric(srv, "kvstore_retained_pages") == 8
            c = retainer.counts
            assert (c.retained, c.pages, c.failed) == (4, 5 + 5 + 8 + 8, 0)
        finally:
            retainer.close(5.0)


def test_the_retain_thread_calls_between_the_schedulers_steps(srv):
    """Asks queued during a step go to the store once the step's plan is built (the
    engine then runs it), not while its lookups run; all in one call."""
    with client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        ks = keys("step", 4)
        a.put(ns, ks, pages(4, ns.page_bytes))
        gate = StepGate()
        retainer = Retainer(StoreLookups(ConnectorConfig(server=srv.address), [LAYOUT], a),
                            gate)
        try:
            gate.begin()
            retainer.submit(RetainAsk("one", 60.0), ks[:2])
            retainer.submit(RetainAsk("two", 60.0), ks)
            time.sleep(0.03)                    # past the linger, within the bound
            assert not retainer.idle() and retainer.counts.retained == 0
            gate.end()
            wait_for(retainer.idle, "the retains to be sent")
            assert (retainer.counts.retained, retainer.counts.pages) == (2, 6)
        finally:
            retainer.close(5.0)
