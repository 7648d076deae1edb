"""A Get of a few pages all in DRAM, to a client that reads aligned answers, takes the
lean read (kvstore_server/store/few_reads.py); every other Get the generic one. Both
against a real server, side by side on two raw connections: the same bytes, the same
refusals, no pin left behind, a deleted page gone, and a token revoked between two
Gets on one open connection refused at the second."""

from __future__ import annotations

import signal
import socket
import time

import numpy as np

from kvstore_client import KVStoreClient
from kvstore_protocol import fastwire as fw
from tests.integration.test_fastpath import (
    LAYOUTS,
    TOKENS,
    Raw,
    _auth_file,
    fast_address,
    keys,
    keys_body,
    pages,
)
from tests.waiting import wait_for


def _aligned(address: str, token: str) -> Raw:
    """A raw connection that was granted ALIGNED (the lean read is for such clients)."""
    raw = Raw(address, hello=False)
    raw.send(fw.Op.HELLO, token.encode(), flags=fw.ALIGNED)
    status, body, _ = raw.answer()
    assert status == 0, body
    return raw


def _get(raw: Raw, layout_id: bytes, ks: list[bytes], pad: int) -> tuple[int, bytes]:
    """(status, the pages' bytes or the error message) of one GET."""
    raw.send(fw.Op.GET, keys_body(layout_id, ks))
    status, body, data_len = raw.answer()
    if status:
        return status, body
    assert body == bytes(pad)
    return status, raw.recv_exact(data_len)


def test_lean_and_generic_gets_agree(fresh_server, tmp_path):
    path = tmp_path / "auth.toml"
    _auth_file(path, ["a", "b", "ops"])
    srv = fresh_server(auth_file=str(path))
    with KVStoreClient(srv.address, token=TOKENS["a"], shared_memory=False,
                       data_plane=True) as c, \
            KVStoreClient(srv.address, token=TOKENS["ops"], shared_memory=False) as ops:
        ns = c.register_layout(LAYOUTS["odd"])
        ks = keys("few", 20)
        data = pages(20, ns.page_bytes, seed=3)
        c.put(ns, ks[:10], data[:10])
        c.put(ns, ks[10:], data[10:])            # likely not beside the first ten
        lean = _aligned(fast_address(srv), TOKENS["a"])
        generic = Raw(fast_address(srv), TOKENS["a"])
        for pick in ([0], [3], [1, 2, 3], [9, 10, 11], [4, 4, 0], [19, 0, 12, 7],
                     list(range(16)), list(range(17))):
            asked = [ks[i] for i in pick]
            want = b"".join(data[i].tobytes() for i in pick)
            assert _get(lean, ns.layout_id, asked, fw.ALIGN_PAD) == (0, want), pick
            assert _get(generic, ns.layout_id, asked, 0) == (0, want), pick
        # A key not stored: both refuse it alike, and the lean read pinned nothing.
        for raw, pad in ((lean, fw.ALIGN_PAD), (generic, 0)):
            status, body = _get(raw, ns.layout_id, [ks[0], b"absent".ljust(20, b".")], pad)
            assert status == fw.Status.NOT_FOUND and b"key 1 of 2" in body
        stats = ops.stats()
        assert stats.pinned_pages == 0 and stats.leases == 0
        # Deleted: gone for the lean read too.
        assert c.delete(ns, ks[:1]) == 1
        assert _get(lean, ns.layout_id, ks[:1], fw.ALIGN_PAD)[0] == fw.Status.NOT_FOUND
        assert _get(lean, ns.layout_id, ks[1:2], fw.ALIGN_PAD) == (0, data[1].tobytes())
        # Revoked between two Gets on the open connection: the second is refused.
        _auth_file(path, ["b", "ops"])
        srv.send_signal(signal.SIGHUP)
        wait_for(lambda: "auth reloaded" in srv.log(), "the reload")
        status, body = _get(lean, ns.layout_id, ks[1:2], fw.ALIGN_PAD)
        assert status == fw.Status.UNAUTHENTICATED and b"invalid token" in body
        lean.close()
        generic.close()


def test_many_lean_gets_leave_no_pin_and_count_each(fresh_server):
    srv = fresh_server()
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        ks = keys("count", 8)
        data = pages(8, ns.page_bytes, seed=4)
        c.put(ns, ks, data)
        before = sum(layout.served for layout in c.stats().layouts)
        raw = _aligned(fast_address(srv), "")
        for i in range(50):
            got = _get(raw, ns.layout_id, ks[i % 8:i % 8 + 2], fw.ALIGN_PAD)
            assert got == (0, data[i % 8:i % 8 + 2].tobytes())
        raw.close()
        after = c.stats()
        assert after.pinned_pages == 0 and after.leases == 0
        served = sum(len(ks[i % 8:i % 8 + 2]) for i in range(50))
        assert sum(layout.served for layout in after.layouts) - before == served
        assert np.array_equal(c.get(ns, ks), data)


def test_a_get_to_a_slow_reader_keeps_its_page_pinned_until_sent(fresh_server):
    """Gets the kernel cannot take whole at once (the reader has stopped reading) are
    pinned and sent after: a delete and puts meanwhile neither free nor overwrite the page
    while its bytes are still going out, and once read every answer is the page as put."""
    srv = fresh_server()
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["mla"])          # 72 KiB pages: sent under the lock
        ks = keys("slow", 1)
        data = pages(1, ns.page_bytes, seed=5)
        c.put(ns, ks, data)
        raw = Raw.__new__(Raw)
        raw.sock = socket.socket()
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        host, _, port = fast_address(srv).rpartition(":")
        raw.sock.connect((host, int(port)))
        raw.sock.settimeout(10)
        raw.send(fw.Op.HELLO, b"", flags=fw.ALIGNED)
        assert raw.answer()[0] == 0
        asked = 40
        for _ in range(asked):
            raw.send(fw.Op.GET, keys_body(ns.layout_id, ks))
        time.sleep(0.5)                                  # the server waits on our window
        assert c.delete(ns, ks) == 1
        others = keys("other", 8)
        c.put(ns, others, pages(8, ns.page_bytes, seed=6))   # would take a freed slot
        statuses = []
        for _ in range(asked):
            status, body, data_len = raw.answer()
            statuses.append(status)
            if status == 0:
                assert body == bytes(fw.ALIGN_PAD)
                assert raw.recv_exact(data_len) == data[0].tobytes()
            else:
                assert status == fw.Status.NOT_FOUND, body
        raw.close()
        served = statuses.index(fw.Status.NOT_FOUND) if fw.Status.NOT_FOUND in statuses \
            else asked
        assert served >= 1 and all(s == fw.Status.NOT_FOUND for s in statuses[served:])
        stats = c.stats()
        assert stats.pinned_pages == 0 and stats.leases == 0
