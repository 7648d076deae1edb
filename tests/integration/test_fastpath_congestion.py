"""--data-congestion: the fast path's TCP connections take the congestion control asked
for (set on the listener, which accepted connections take), the server says which in its
log, and calls over it work as over any other; KVStoreClient(data_congestion=...) does
the same for its end. Read from the kernel's own view of the sockets (`ss -ti`), so the
test needs iproute2's ss."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import numpy as np
import pytest

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.config import ConnectorConfig, open_client
from kvstore_testing.serverproc import ServerProcess

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss")

LAYOUT = PageLayout(model="congestion", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64, dtype="bfloat16")


def _sysctl(name: str) -> list[str]:
    with open(f"/proc/sys/net/ipv4/{name}") as f:
        return f.read().split()


def _host_default() -> str:
    return _sysctl("tcp_congestion_control")[0]


def _ends(port: int, side: str) -> list[set[str]]:
    """The words of ss's info line for each established connection with port as its
    local ("sport": the server's ends) or remote ("dport": the clients' ends) port."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( {side} = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    return [set(info.split()) for info in lines[1::2]]


def _server_side(port: int) -> list[set[str]]:
    return _ends(port, "sport")


def _calls_over_the_fast_path(srv: ServerProcess) -> list[set[str]]:
    """A put, a lookup and a get whose bytes are checked, over the fast path; then what ss
    says of the server's end of the client's connections (held open while it looks: a
    client that fell back to gRPC would have none on the data port)."""
    keys = [f"k{i}".encode() for i in range(4)]
    pages = np.arange(4 * LAYOUT.page_bytes, dtype=np.uint64).astype(np.uint8).reshape(
        4, LAYOUT.page_bytes)
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True,
                       data_connections=1) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, keys, pages)
        assert c.lookup(ns, keys) == 4
        np.testing.assert_array_equal(c.get(ns, keys), pages)
        seen = _server_side(srv.port + 1)
        assert seen, "no fast-path connection seen by ss"
        return seen


@pytest.mark.parametrize("name", ["reno", "cubic"])
def test_connections_take_the_congestion_control_asked_for(name):
    # Two names, so that at least one is not the host's default whatever that is; one
    # this kernel lacks, or does not let this user pick, cannot be had here.
    if name not in _sysctl("tcp_available_congestion_control"):
        pytest.skip(f"this kernel has no {name}")
    if os.geteuid() and name not in _sysctl("tcp_allowed_congestion_control"):
        pytest.skip(f"{name} is not allowed for this user")
    with ServerProcess(dram="64MiB", data_congestion=name).start(wait=120) as srv:
        seen = _calls_over_the_fast_path(srv)
        assert all(name in words for words in seen), seen
        assert f"(TCP congestion control {name})" in srv.log()


def test_without_it_connections_take_the_host_s():
    default = _host_default()
    with ServerProcess(dram="64MiB").start(wait=120) as srv:
        seen = _calls_over_the_fast_path(srv)
        assert all(default in words for words in seen), seen
        assert f"(TCP congestion control {default})" in srv.log()


def test_the_bench_s_raw_peer_sends_under_the_same():
    """`kvstore-bench fastpath --sweep --congestion NAME` gives the raw peer the server's
    congestion control (bench/rawpeer.py), so both ends' answers are sent alike."""
    from kvstore_bench.fastpath_sweep import _RawPeer
    from kvstore_bench.rawpeer import RawClient
    name = next(n for n in ("reno", "cubic") if n != _host_default())
    peer = _RawPeer(congestion=name)
    try:
        client = RawClient("127.0.0.1", peer.port)
        out = memoryview(bytearray(1 << 16))
        client.get(out)                          # the peer's bytes came: it is serving
        assert bytes(out[:4]) == b"\x01" * 4
        seen = _server_side(peer.port)
        assert seen and all(name in words for words in seen), seen
        client.close()
    finally:
        peer.close()


def test_a_client_s_connections_take_the_one_it_asks_for():
    name = next(n for n in ("reno", "cubic") if n != _host_default())
    with ServerProcess(dram="64MiB").start(wait=120) as srv, \
            KVStoreClient(srv.address, shared_memory=False, data_plane=True,
                          data_connections=1, data_congestion=name) as c:
        ns = c.register_layout(LAYOUT)
        pages = np.full((2, LAYOUT.page_bytes), 7, dtype=np.uint8)
        c.put(ns, [b"a", b"b"], pages)
        np.testing.assert_array_equal(c.get(ns, [b"a", b"b"]), pages)
        mine, theirs = _ends(srv.port + 1, "dport"), _server_side(srv.port + 1)
        assert mine and all(name in words for words in mine), mine
        # The server's ends keep its own (the host's default here).
        assert theirs and all(_host_default() in words for words in theirs), theirs


def test_a_client_asking_for_one_the_host_lacks_is_refused_at_once():
    with pytest.raises(ValueError, match="no TCP congestion control 'nosuch'"):
        KVStoreClient("127.0.0.1:1", data_congestion="nosuch")


def test_an_engine_s_connections_take_the_one_its_connector_config_names():
    # What an engine's saves are sent under: kv_connector_extra_config's data_congestion
    # reaches the client the connector opens (open_client), on every fast-path connection.
    name = next(n for n in ("reno", "cubic") if n != _host_default())
    config = ConnectorConfig.from_mapping({"data_congestion": name, "shared_memory": False})
    with ServerProcess(dram="64MiB").start(wait=120) as srv:
        config = dataclasses.replace(config, server=srv.address)
        # As the worker half opens it: a remote engine's, its pages over TCP.
        with open_client(config, timeout=10.0, shared_memory=config.shared_memory,
                         data_connections=2) as c:
            ns = c.register_layout(LAYOUT)
            pages = np.full((2, LAYOUT.page_bytes), 3, dtype=np.uint8)
            c.put(ns, [b"a", b"b"], pages)
            np.testing.assert_array_equal(c.get(ns, [b"a", b"b"]), pages)
            mine = _ends(srv.port + 1, "dport")
            assert mine and all(name in words for words in mine), mine
