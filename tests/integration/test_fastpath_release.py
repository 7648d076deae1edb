"""A release not waited for (release_lease_later) over TCP: a QUIET RELEASE that the
client holds and sends in one send with the lane's next request (Conn.hold), or by
itself HOLD_S later when none follows (kvstore_client.ahead), or when the client closes."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.ahead import HOLD_S
from kvstore_protocol import fastwire as fw
from kvstore_testing.serverproc import ServerProcess
from tests.integration.test_fastpath import Raw, fast_address, keys_body
from tests.waiting import wait_for

LAYOUT = PageLayout(model="fp-release", num_layers=1, page_tokens=1, num_kv_heads=1,
                    head_size=8, dtype="int8")                            # 16-byte pages
KEYS = [f"release-{i}".encode().ljust(16, b".") for i in range(4)]


@pytest.fixture(scope="module")
def srv():
    with ServerProcess(dram="64MiB") as server:
        yield server


def _tcp_client(srv: ServerProcess) -> KVStoreClient:
    return KVStoreClient(srv.address, shared_memory=False, data_plane=True,
                         data_address=f"127.0.0.1:{srv.port + 1}")


def _leases(srv: ServerProcess) -> int:
    with KVStoreClient(srv.address, data_plane=False) as c:
        return c.stats().leases


def test_a_release_sent_ahead_is_applied_once_the_next_call_is_answered(srv):
    """The release that rode ahead of the next call is applied right after that call's
    answer (Connection._apply), with no waiting for anything more from the client."""
    with _tcp_client(srv) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
        assert c.fast_path()._reads.conn is None or c.fast_path()._reads.conn.tcp
        for _ in range(3):
            lease = c.lookup_lease(ns, KEYS, lease_ms=60_000)
            assert lease.count == len(KEYS)
            assert c.fast_path()._reads.conn.tcp and c.fast_path()._reads.conn.quiet
            c.release_lease_later(lease)
            again = c.lookup_lease(ns, KEYS[:1], lease_ms=60_000)    # the same lane
            assert again.count == 1
            wait_for(lambda: _leases(srv) == 1, "the release sent ahead to be applied",
                     timeout=5)
            c.release_lease(again)
            assert _leases(srv) == 0


def test_a_release_with_no_call_after_it_still_reaches_the_server(srv):
    """Nothing follows on the lane: the kernel sends the held frame by itself (its probe
    timer, TCP_RTO_MIN), so the pages are not pinned until the lease's ttl."""
    with _tcp_client(srv) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
        lease = c.lookup_lease(ns, KEYS, lease_ms=600_000)
        assert _leases(srv) == 1
        c.release_lease_later(lease)
        wait_for(lambda: _leases(srv) == 0, "the held release to be sent", timeout=10)
        assert c.fast_path()._reads.conn is not None        # not by closing the lane


def test_a_lane_that_breaks_after_a_release_sent_ahead_loses_no_lease(srv):
    """The connection is reset with the release still in its send queue (lost): the
    server ends the leases of a connection that ended, and the next call goes on a
    fresh connection."""
    with _tcp_client(srv) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
        lease = c.lookup_lease(ns, KEYS, lease_ms=600_000)
        c.release_lease_later(lease)
        conn = c.fast_path()._reads.conn
        # SO_LINGER 0: close() resets the connection and drops what was not sent.
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.sock.close()
        wait_for(lambda: _leases(srv) == 0, "the reset connection's lease to end",
                 timeout=10)
        again = c.lookup_lease(ns, KEYS[:2], lease_ms=60_000)
        assert again.count == 2 and c.fast_path()._reads.conn is not conn
        c.release_lease(again)
        assert _leases(srv) == 0


def test_a_held_release_goes_in_the_next_requests_send(srv):
    """Held in the client, not sent, until the lane's next request: then both go in one
    send, and the release is applied once that request is answered."""
    with _tcp_client(srv) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
        lease = c.lookup_lease(ns, KEYS, lease_ms=600_000)
        conn = c.fast_path()._reads.conn
        c.release_lease_later(lease)
        assert conn.held, "the release was sent at once, not held"
        again = c.lookup_lease(ns, KEYS[:1], lease_ms=600_000)
        assert conn.held == b"" and c.fast_path()._reads.conn is conn
        wait_for(lambda: _leases(srv) == 1, "the held release to be applied", timeout=5)
        c.release_lease(again)
        assert _leases(srv) == 0


def test_a_held_release_with_no_request_after_it_is_sent_by_the_flusher(srv):
    """No request follows: the flusher sends it by itself within HOLD_S (and a bit), on
    the same connection, and the lease ends well before its ttl."""
    with _tcp_client(srv) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
        for _ in range(3):                      # armed again after each flush
            lease = c.lookup_lease(ns, KEYS, lease_ms=600_000)
            conn = c.fast_path()._reads.conn
            c.release_lease_later(lease)
            began = time.monotonic()
            wait_for(lambda: _leases(srv) == 0, "the flusher to send the release",
                     timeout=10)
            assert time.monotonic() - began < HOLD_S + 5.0
            assert conn.held == b"" and c.fast_path()._reads.conn is conn


def test_a_held_release_of_a_pinned_lease_is_sent_when_the_client_closes(srv):
    """A lease with pins outlives its connection (another process reads under it), so
    a release held when the client closes must still be sent: close sends it."""
    c = _tcp_client(srv)
    ns = c.register_layout(LAYOUT)
    c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
    lease = c.lookup_lease(ns, KEYS, lease_ms=600_000, pins=True)
    assert lease.pins is not None, "no pins: the test needs a lease that outlives closing"
    c.release_lease_later(lease)
    assert c.fast_path()._reads.conn.held
    c.close()
    wait_for(lambda: _leases(srv) == 0, "the held release sent at close", timeout=10)


def test_quiet_releases_ahead_of_a_request_are_all_applied_after_its_answer(srv):
    """More quiet releases than the server holds back at once (connection._LATER_MAX),
    then a lookup, in one send: the lookup is answered as if they had come alone, and
    every one of them is applied, those held back for it right after its answer."""
    n = 100
    with _tcp_client(srv) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
        # Leased on another connection: a lease is its tenant's, not its connection's.
        with KVStoreClient(srv.address, data_plane=False) as g:
            leases = [g.lookup_lease(ns, KEYS[:1], lease_ms=600_000) for _ in range(n)]
        assert _leases(srv) == n
        raw = Raw(fast_address(srv))
        try:
            quiet = b"".join(fw.encode_header(fw.Op.RELEASE, fw.LEASE.size, flags=fw.QUIET)
                             + fw.LEASE.pack(lease.lease_id) for lease in leases)
            lookup = fw.LOOKUP_HEAD.pack(0, 1) + ns.layout_id + fw.encode_keys(
                16, b"".join(KEYS))
            raw.sock.sendall(quiet + fw.encode_header(fw.Op.LOOKUP, len(lookup)) + lookup)
            status, body, _ = raw.answer()          # the lookup's: no release answers
            assert status == 0 and fw.COUNT_LEASE.unpack_from(body) == (len(KEYS), 0)
            wait_for(lambda: _leases(srv) == 0, "every quiet release to be applied",
                     timeout=5)
            status, body = raw.call(fw.Op.EXISTS, keys_body(ns.layout_id, KEYS[:1]))
            assert status == 0                      # and the connection is in step
        finally:
            raw.close()


def test_a_quiet_release_held_back_is_applied_when_the_frame_behind_it_breaks_off(srv):
    """The release is held back for the frame behind it, and that frame never comes
    whole (the client goes): the release still applies. The lease was taken over gRPC,
    so the end of this connection's own leases would not have ended it."""
    with _tcp_client(srv) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
    with KVStoreClient(srv.address, data_plane=False) as g:
        lease = g.lookup_lease(ns, KEYS, lease_ms=600_000)
    assert _leases(srv) == 1
    raw = Raw(fast_address(srv))
    try:
        quiet = fw.encode_header(fw.Op.RELEASE, fw.LEASE.size, flags=fw.QUIET) \
            + fw.LEASE.pack(lease.lease_id)
        # A LOOKUP that says 100 bytes of body follow, and 10 that do.
        raw.sock.sendall(quiet + fw.encode_header(fw.Op.LOOKUP, 100) + bytes(10))
    finally:
        raw.close()
    wait_for(lambda: _leases(srv) == 0, "the held-back release to be applied", timeout=5)


@pytest.mark.parametrize("op", [fw.Op.RELEASE, fw.Op.COMMIT, fw.Op.ABORT])
def test_a_lease_body_with_bytes_past_its_form_is_refused_and_ends_nothing(srv, op):
    """A RELEASE's body is a lease id (8 bytes) or a lease id and the pages read (12); a
    COMMIT's or ABORT's the id alone. Bytes past that were read and ignored: the lease
    ended all the same. Now the frame is refused, saying what the body should be, and
    the lease lives on."""
    with _tcp_client(srv) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, KEYS, np.ones((len(KEYS), ns.page_bytes), np.uint8))
    with KVStoreClient(srv.address, data_plane=False) as g:
        lease = g.lookup_lease(ns, KEYS, lease_ms=600_000)
        before = _leases(srv)
        raw = Raw(fast_address(srv))
        try:
            for body in (fw.LEASE.pack(lease.lease_id) + bytes(5),
                         fw.LEASE.pack(lease.lease_id) + bytes((64 << 10) - 64)):
                status, answer = raw.call(op, body)
                assert status == fw.Status.INVALID, (status, answer)
                assert f"not {len(body)}" in answer.decode(), answer
                assert b"8 bytes (a lease id)" in answer
            assert _leases(srv) == before       # the lease was not ended
            status, _ = raw.call(fw.Op.EXISTS, keys_body(ns.layout_id, KEYS[:1]))
            assert status == 0                  # and the connection is in step
        finally:
            raw.close()
        assert g.release_lease(lease)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_quiet_releases_held_back_are_only_those_of_a_release_s_size(srv):
    """A quiet RELEASE is held back, as a copy of its body, when the next frame's header
    came with its last bytes; 64 at most. A peer that sends each body's last bytes with
    the next header had the server hold up to 64 copies of bodies as long as the
    request limit, a connection: 16 connections of 63 releases of 60 KiB took 60 MiB.
    Only a release's own 8 or 12 bytes are held back now: a longer body is refused at
    once, and the server's memory stays where it was."""
    with KVStoreClient(srv.address, data_plane=False) as c:
        ns = c.register_layout(LAYOUT)
    body = bytes(60 << 10)
    frame = fw.encode_header(fw.Op.RELEASE, len(body), flags=fw.QUIET) + body
    cut = len(frame) - 100                      # each body's last 100 bytes come late
    raws = []
    try:
        before = _rss_kib(srv.proc.pid)
        for _ in range(16):
            raws.append(Raw(fast_address(srv)))
            raws[-1].sock.sendall(frame[:cut])
        for _ in range(62):
            time.sleep(0.02)                    # the server reads up to the cut, and waits
            for raw in raws:
                raw.sock.sendall(frame[cut:] + frame[:cut])
        time.sleep(0.02)
        for raw in raws:        # the 63rd's end and the 64th's header: the server waits
            raw.sock.sendall(frame[cut:] + frame[:fw.HEADER.size + 100])
        time.sleep(1.0)
        grown = _rss_kib(srv.proc.pid) - before
        assert grown < 24 << 10, f"the server grew {grown} KiB"
        for raw in raws:
            raw.sock.sendall(frame[fw.HEADER.size + 100:])
            status, _ = raw.call(fw.Op.EXISTS, keys_body(ns.layout_id, KEYS[:1]))
            assert status == 0                  # in step all the same
    finally:
        for raw in raws:
            raw.close()
