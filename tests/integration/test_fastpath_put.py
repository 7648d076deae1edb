"""A fast-path Put of a few pages (received whole, then stored in one step: Store.put_bytes)
against a real kvstore-server with tenants: byte-exact, duplicates skipped, and refused
whole (oversize data, over quota, a layout not the caller's, a cut connection) with a
clear error, nothing stored, the connection going on."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_protocol import fastwire as fw
from kvstore_testing.serverproc import ServerProcess
from tests.integration.test_fastpath import Raw, fast_address, keys_body

# 64 KiB pages: three fit the 256 KiB a put is received whole in; two fill "small"'s quota.
LAYOUT = PageLayout(model="fused-put", num_layers=32, page_tokens=16, num_kv_heads=1,
                    head_size=32)
TOKENS = {"a": "tok-fused-a", "b": "tok-fused-b", "small": "tok-fused-small"}


def _keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def _pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_bytes), dtype=np.uint8)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = tmp_path_factory.mktemp("fused") / "auth.toml"
    entries = {"a": "", "b": "", "small": 'quota = "128KiB"'}
    path.write_text("\n".join(
        f'[tenants.{name}]\ntoken_sha256 = "{hashlib.sha256(TOKENS[name].encode()).hexdigest()}"'
        f"\n{extra}\n" for name, extra in entries.items()))
    with ServerProcess(dram="64MiB", auth_file=str(path)) as server:
        yield server


def _client(srv, name: str) -> KVStoreClient:
    return KVStoreClient(srv.address, token=TOKENS[name], retries=0, shared_memory=False,
                         data_plane=True)


def test_pages_are_stored_exactly_and_repeats_skipped(srv):
    with _client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        k = _keys("dup", 3)
        data = _pages(3, seed=1)
        put = a.put(ns, [k[0], k[0], k[1]], np.stack([data[0], data[2], data[1]]))
        assert (put.stored, put.skipped) == (2, 1)       # the repeat is skipped
        put = a.put(ns, [k[0], k[2]], np.stack([data[2], data[2]]))
        assert (put.stored, put.skipped) == (1, 1)       # k0 is stored already: kept
        np.testing.assert_array_equal(a.get(ns, k), data)
        a.delete(ns, k)


def test_over_quota_is_refused_whole_and_the_connection_goes_on(srv):
    with _client(srv, "small") as s:
        ns = s.register_layout(LAYOUT)
        k = _keys("quota", 3)
        with pytest.raises(KVStoreError) as info:
            s.put(ns, k, _pages(3))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'small'" in info.value.message and "quota" in info.value.message
        assert s.exists(ns, k) == [False] * 3
        assert s.put(ns, k[:2], _pages(2, seed=2)).stored == 2       # within it: stored
        np.testing.assert_array_equal(s.get(ns, k[:2]), _pages(2, seed=2))
        s.delete(ns, k)


def _hello(srv, name: str) -> Raw:
    raw = Raw(fast_address(srv), hello=False)
    raw.send(fw.Op.HELLO, TOKENS[name].encode())
    status, _, _ = raw.answer()
    assert status == 0
    return raw


def test_data_that_does_not_fill_the_pages_is_refused_and_skipped(srv):
    with _client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
    k = _keys("short", 2)
    raw = _hello(srv, "a")
    try:
        raw.send(fw.Op.PUT, keys_body(ns.layout_id, k), data_len=LAYOUT.page_bytes)
        raw.sock.sendall(bytes(LAYOUT.page_bytes))
        status, body, _ = raw.answer()
        assert status == fw.Status.INVALID
        assert b"needs 131072 bytes of data, the request says 65536" in body
        # The connection is in step: the next request is answered.
        status, body = raw.call(fw.Op.EXISTS, keys_body(ns.layout_id, k))
        assert status == 0 and fw.COUNT.unpack_from(body)[0] == 2 and body[4:] == b"\0"
    finally:
        raw.close()


def test_a_layout_not_the_callers_is_unknown_and_nothing_is_stored(srv):
    other = PageLayout(model="fused-put-a-only", num_layers=32, page_tokens=16,
                       num_kv_heads=1, head_size=32)
    k = _keys("foreign", 1)
    with _client(srv, "a") as a:
        ns = a.register_layout(other)
        raw = _hello(srv, "b")                  # b never registered it
        try:
            raw.send(fw.Op.PUT, keys_body(ns.layout_id, k), data_len=LAYOUT.page_bytes)
            raw.sock.sendall(bytes(LAYOUT.page_bytes))
            status, body, _ = raw.answer()
            assert status == fw.Status.INVALID
            assert body.startswith(f"unknown layout {ns.layout_id.hex()}".encode())
        finally:
            raw.close()
        assert a.exists(ns, k) == [False]


def test_a_connection_cut_inside_the_data_stores_nothing(srv):
    with _client(srv, "a") as a:
        ns = a.register_layout(LAYOUT)
        k = _keys("cut", 2)
        raw = _hello(srv, "a")
        raw.send(fw.Op.PUT, keys_body(ns.layout_id, k), data_len=2 * LAYOUT.page_bytes)
        raw.sock.sendall(bytes(LAYOUT.page_bytes + 100))
        raw.close()
        assert a.exists(ns, k) == [False, False]
        assert a.put(ns, k, _pages(2, seed=3)).stored == 2           # the keys are free
        a.delete(ns, k)
