"""The removal ring through a real server (KVStore.Removals): what leaves the server's
last tier is read back in order with its cause, a reader that fell behind the ring or
a restart is told of a gap, requests are bounded, and a tenant reads only its own
layouts."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from tests.waiting import wait_for

LAYOUT = PageLayout(model="removals", num_layers=2, page_tokens=16, num_kv_heads=8,
                    head_size=128)          # 128 KiB pages
EVICTED, DELETED, INVALIDATED = 1, 2, 3


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def pages(n: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def connect(srv, token: str | None = None) -> KVStoreClient:
    return KVStoreClient(srv.address, token=token, shared_memory=False, data_plane=False,
                         retries=0)


def read_all(c: KVStoreClient, handles, cursor):
    """Every entry after the cursor, following `more`: (entries, last read)."""
    entries = []
    while True:
        got = c.removals(handles, cursor.next_seq, cursor.epoch)
        entries += got.entries
        cursor = got
        if not got.more:
            return entries, got


def test_deletes_evictions_and_an_invalidation_in_order(fresh_server):
    srv = fresh_server(dram="16MiB")
    with connect(srv) as c:
        ns = c.register_layout(LAYOUT)
        start = c.removals([ns])
        assert (start.entries, start.gap) == ((), False)
        ks = keys("p", 8)
        c.put(ns, ks, pages(8, ns.page_bytes))
        c.delete(ns, ks[:2])
        c.admin.evict(layout_id=ns.layout_id)       # no disk: gone
        entries, last = read_all(c, [ns], start)
        assert [(e.key, e.cause) for e in entries[:2]] == [(k, DELETED) for k in ks[:2]]
        assert sorted(e.key for e in entries[2:]) == sorted(ks[2:])
        assert {e.cause for e in entries[2:]} == {EVICTED}
        seqs = [e.seq for e in entries]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert not last.gap and last.next_seq == seqs[-1]
        # A pool filled past its size evicts the oldest pages; each is announced once.
        n = 16 * (1 << 20) // ns.page_bytes
        for part in range(3):
            c.put(ns, keys(f"fill{part}", n // 2), pages(n // 2, ns.page_bytes))
        filled, last = read_all(c, [ns], last)
        assert filled and {e.cause for e in filled} == {EVICTED}
        present = {k for k, held in zip(keys("fill0", n // 2),
                                           c.exists(ns, keys("fill0", n // 2))) if not held}
        assert present <= {e.key for e in filled}
        c.put(ns, keys("q", 2), pages(2, ns.page_bytes))
        c.admin.invalidate(layout_id=ns.layout_id)
        inv, _ = read_all(c, [ns], last)
        assert inv[-1].key == b"" and inv[-1].cause == INVALIDATED
        assert inv[-1].layout_id == ns.layout_id      # the client's id, not the scoped one


def test_pages_moving_to_disk_are_not_removed_until_the_disk_lets_them_go(
        fresh_server, tmp_path):
    srv = fresh_server(dram="16MiB", disk="2MiB", disk_dir=str(tmp_path / "disk"))
    with connect(srv) as c:
        ns = c.register_layout(LAYOUT)
        start = c.removals([ns])
        ks = keys("d", 4)
        c.put(ns, ks, pages(4, ns.page_bytes))
        admin = c.admin
        admin.evict(everything=True)                    # DRAM -> disk: still held here
        assert all(c.exists(ns, ks))
        assert c.removals([ns], start.next_seq, start.epoch).entries == ()
        # The 2 MiB disk tier takes ~15 pages: more pushes the first four out for good.
        for part in range(4):
            c.put(ns, keys(f"m{part}", 8), pages(8, ns.page_bytes))
            admin.evict(everything=True)
        gone: set[bytes] = set()
        cursor = start

        def all_evicted() -> bool:
            nonlocal cursor
            got, cursor = read_all(c, [ns], cursor)
            gone.update(e.key for e in got if e.cause == EVICTED)
            return set(ks) <= gone
        wait_for(all_evicted, "every first page's eviction told", timeout=20, interval=0.1)
        assert not any(c.exists(ns, ks))


def test_a_reader_behind_the_ring_or_a_restart_gets_a_gap(fresh_server):
    srv = fresh_server(dram="16MiB", removal_ring=8)
    with connect(srv) as c:
        ns = c.register_layout(LAYOUT)
        start = c.removals([ns])
        ks = keys("g", 20)
        c.put(ns, ks, pages(20, ns.page_bytes))
        c.delete(ns, ks)
        got = c.removals([ns], start.next_seq, start.epoch)
        assert got.gap and [e.key for e in got.entries] == ks[12:]
        again = c.removals([ns], got.next_seq, got.epoch)
        assert not again.gap and again.entries == ()
        # Another epoch (what a restart gives): a gap, whatever the cursor.
        assert c.removals([ns], got.next_seq, got.epoch ^ 2).gap


def test_requests_are_bounded(fresh_server):
    srv = fresh_server(dram="16MiB")
    with connect(srv) as c:
        ns = c.register_layout(LAYOUT)
        start = c.removals([ns])
        c.put(ns, keys("b", 30), pages(30, ns.page_bytes))
        c.delete(ns, keys("b", 30))
        got = c.removals([ns], start.next_seq, start.epoch, limit=7)
        assert len(got.entries) == 7 and got.more
        with pytest.raises(KVStoreError) as err:
            c.removals([ns] * 257, start.next_seq, start.epoch)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 256" in str(err.value)
        huge = c.removals([ns], start.next_seq, start.epoch, limit=2 ** 32 - 1)
        assert len(huge.entries) == 30                  # capped, not refused


def test_a_tenant_reads_only_its_own_layouts(fresh_server, tmp_path):
    tokens = {"a": "tok-rm-a", "b": "tok-rm-b"}
    path = tmp_path / "auth.toml"
    path.write_text("".join(f'[tenants.{name}]\ntoken_sha256 = '
                            f'"{hashlib.sha256(t.encode()).hexdigest()}"\n\n'
                            for name, t in tokens.items()))
    srv = fresh_server(dram="16MiB", auth_file=str(path))
    with connect(srv, tokens["a"]) as a, connect(srv, tokens["b"]) as b:
        na = a.register_layout(LAYOUT)
        other = PageLayout(model="removals-b", num_layers=2, page_tokens=16,
                           num_kv_heads=8, head_size=128)
        nb = b.register_layout(other)
        start_a, start_b = a.removals([na]), b.removals([nb])
        a.put(na, keys("a", 3), pages(3, na.page_bytes))
        a.delete(na, keys("a", 3))
        # b names a's layout (raw, without the client's re-registering recovery): it is
        # unknown to b, whatever a holds.
        with pytest.raises(grpc.RpcError) as err:
            b._rpc.unary("Removals")(pb.RemovalsRequest(layout_ids=[na.layout_id],
                                                          epoch=start_b.epoch), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown layout" in err.value.details()
        assert b.removals([nb], start_b.next_seq, start_b.epoch).entries == ()
        # The same layout registered by b is b's own: a's removals are not in it.
        nb_same = b.register_layout(LAYOUT)
        assert b.removals([nb_same], start_b.next_seq, start_b.epoch).entries == ()
        assert len(a.removals([na], start_a.next_seq, start_a.epoch).entries) == 3
