"""kvstore-admin run as a subprocess against a real server, after pages are put with the client."""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvstore_client import KVStoreClient, LayoutHandle, PageLayout
from kvstore_protocol.units import parse_size
from kvstore_testing.serverproc import free_port

# 32 KiB and 64 KiB pages: multiples of the pool's 4 KiB slot alignment, so a layout's
# used bytes are exactly pages * page_bytes.
LAYOUT_A = PageLayout(model="llama-test", num_layers=4, page_tokens=16, num_kv_heads=2,
                      head_size=64, dtype="bfloat16")
LAYOUT_B = PageLayout(model="mla-test", num_layers=8, page_tokens=32, num_kv_heads=1,
                      head_size=128, dtype="float16", kv_factor=1, tp_rank=1, tp_size=2)
N_A, N_B = 10, 4


def admin(address: str | None, *args: str, env: dict | None = None,
          **kw) -> subprocess.CompletedProcess:
    """Run kvstore-admin with no terminal on stdin; returns the finished process."""
    argv = [sys.executable, "-m", "kvstore_client.admin_cli"]
    argv += ["--server", address] if address else []
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, **(env or {})}, **kw)


def admin_json(address: str, *args: str):
    proc = admin(address, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore-admin: "), proc.stderr
    for needle in needles:
        assert needle in lines[0]


@dataclasses.dataclass
class Filled:
    address: str
    client: KVStoreClient
    a: LayoutHandle
    b: LayoutHandle
    keys_a: list[bytes]
    keys_b: list[bytes]

    def pages(self, handle: LayoutHandle) -> int:
        return sum(self.client.exists(handle, self.keys_a if handle is self.a else self.keys_b))


def fill(address: str) -> Filled:
    """Layout A: 10 pages, 3 read with Get, a lookup with 2 hits and 2 misses. B: 4 pages."""
    client = KVStoreClient(address)
    a, b = client.register_layout(LAYOUT_A), client.register_layout(LAYOUT_B)
    keys_a = [b"a" + i.to_bytes(2, "big") for i in range(N_A)]
    keys_b = [b"b" + i.to_bytes(2, "big") for i in range(N_B)]
    rng = np.random.default_rng(0)
    client.put(a, keys_a, rng.integers(0, 256, (N_A, a.page_bytes), dtype=np.uint8))
    client.put(b, keys_b, rng.integers(0, 256, (N_B, b.page_bytes), dtype=np.uint8))
    client.get(a, keys_a[:3])
    assert client.lookup(a, [keys_a[0], keys_a[1], b"zzz", keys_a[3]]) == 2
    return Filled(address, client, a, b, keys_a, keys_b)


@pytest.fixture(scope="module")
def shared(server):
    """Pages on the module's server, for tests that only read."""
    filled = fill(server.address)
    yield filled
    filled.client.close()


@pytest.fixture
def filled(fresh_server):
    """Pages on a server of the test's own, for tests that check totals or change state."""
    filled = fill(fresh_server().address)
    yield filled
    filled.client.close()


# -- stats ---------------------------------------------------------------------------
def test_stats_json_matches_what_was_put(filled):
    lease = filled.client.lookup_lease(filled.a, filled.keys_a[:5], lease_ms=60_000)
    data = admin_json(filled.address, "stats")
    a, b = filled.a, filled.b
    (dram,) = data["tiers"]
    total_bytes = N_A * a.page_bytes + N_B * b.page_bytes
    assert dram["name"] == "dram" and dram["capacity_bytes"] == 64 << 20
    assert dram["pages"] == N_A + N_B and dram["used_bytes"] == total_bytes
    assert dram["bytes_in"] == total_bytes and dram["bytes_out"] == 3 * a.page_bytes
    # hits and misses count Lookup only: 2 + 5 hits, 2 misses (the Get adds none)
    assert (dram["hits"], dram["misses"], dram["evictions"]) == (2 + 5, 2, 0)
    assert data["leases"] == 1 and data["leased_pages"] == lease.count == 5
    assert data["uptime_seconds"] > 0 and data["version"]
    by_id = {entry["layout_id"]: entry for entry in data["layouts"]}
    assert set(by_id) == {a.layout_id.hex(), b.layout_id.hex()}
    la, lb = by_id[a.layout_id.hex()], by_id[b.layout_id.hex()]
    assert la["layout"]["model"] == "llama-test" and la["layout"]["num_layers"] == 4
    assert (la["page_bytes"], la["pages"], la["used_bytes"]) == (32768, N_A, N_A * 32768)
    assert (la["hits"], la["misses"], la["bytes_out"]) == (7, 2, 3 * 32768)
    assert lb["layout"]["dtype"] == "float16" and lb["layout"]["tp_rank"] == 1
    assert (lb["page_bytes"], lb["pages"], lb["hits"], lb["misses"]) == (65536, N_B, 0, 0)


def test_stats_human_tables(shared):
    proc = admin(shared.address, "stats")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for header in ("tier", "capacity", "use %", "hit rate", "bytes in", "bytes out",
                   "layout id", "page tokens", "evictions", "leased pages", "uptime"):
        assert header in out
    assert "64.0 MiB" in out
    row_a = next(line for line in out.splitlines() if shared.a.layout_id.hex() in line)
    assert row_a.split()[:6] == [shared.a.layout_id.hex(), "llama-test", "bfloat16", "4",
                                 "16", "0/1"]
    assert "32.0 KiB" in row_a and "320.0 KiB" in row_a
    row_b = next(line for line in out.splitlines() if shared.b.layout_id.hex() in line)
    assert "mla-test" in row_b and "1/2" in row_b and "256.0 KiB" in row_b


def _read_lines(proc: subprocess.Popen, enough: Callable[[list[str]], bool],
                deadline: float) -> list[str]:
    """Lines the process prints, read as they come, until enough(lines) holds; past the
    deadline or at its exit first, AssertionError with what it printed."""
    fd = proc.stdout.fileno()
    lines: list[str] = []
    partial = b""
    while not enough(lines):
        left = deadline - time.monotonic()
        assert left > 0, f"{len(lines)} lines in time: {lines[-5:]}"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        assert chunk, f"exited first ({proc.wait()}): {proc.stderr.read().decode()}"
        *done, partial = (partial + chunk).split(b"\n")
        lines += [line.decode() for line in done]
    return lines


@pytest.mark.parametrize("json_flag", [True, False], ids=["json", "human"])
def test_stats_watch_reprints_until_sigint(shared, json_flag):
    # A generous --timeout: on a loaded machine one Stats call may take seconds, and an
    # answer that comes late is not what this test is about. Every wait below has one
    # deadline and reads whatever has come, so nothing depends on how fast reports come.
    argv = [sys.executable, "-m", "kvstore_client.admin_cli", "--server", shared.address,
            "--timeout", "60", "stats", "--watch", "0.1"] + (["--json"] if json_flag else [])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if json_flag:
            lines = _read_lines(proc, lambda lines: len(lines) >= 3,
                                time.monotonic() + 120)
            for line in lines:
                report = json.loads(line)      # one object per line
                assert report["tiers"][0]["pages"] >= N_A + N_B
        else:
            # The third report has begun once its header is out; its table follows.
            _read_lines(proc, lambda lines: sum(x.startswith("--- ") for x in lines) >= 3,
                        time.monotonic() + 120)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert err.decode() == ""


# -- layouts -------------------------------------------------------------------------
def test_layouts_human_and_json(shared):
    proc = admin(shared.address, "layouts")
    assert proc.returncode == 0, proc.stderr
    for handle in (shared.a, shared.b):
        assert handle.layout_id.hex() in proc.stdout
    assert "llama-test" in proc.stdout and "kv heads" in proc.stdout
    entries = {e["layout_id"]: e for e in admin_json(shared.address, "layouts")}
    b = entries[shared.b.layout_id.hex()]
    assert b["layout"] == {"model": "mla-test", "dtype": "float16", "num_layers": 8,
                           "page_tokens": 32, "num_kv_heads": 1, "head_size": 128,
                           "kv_factor": 1, "tp_rank": 1, "tp_size": 2, "pp_rank": 0, "salt": "",
                           "revision": ""}
    assert b["page_bytes"] == LAYOUT_B.page_bytes and b["pages"] == N_B


# -- evict ---------------------------------------------------------------------------
def test_evict_layout_leaves_the_others(filled):
    prefix = filled.a.layout_id.hex()[:8]       # a unique prefix is enough
    proc = admin(filled.address, "evict", "--layout", prefix)
    assert proc.returncode == 0, proc.stderr
    assert f"evicted {N_A} pages (320.0 KiB)" in proc.stdout
    assert filled.pages(filled.a) == 0 and filled.pages(filled.b) == N_B
    stats = filled.client.stats()
    assert stats.tiers[0].pages == N_B and stats.tiers[0].evictions == N_A


@pytest.mark.lru_order
def test_evict_bytes_takes_least_recently_used(filled):
    # A's pages 3..9 were put first and never read: they are the oldest.
    result = admin_json(filled.address, "evict", "--bytes", "64KiB")
    assert result == {"pages": 2, "bytes": 65536, "skipped_leased": 0,
                      "leases_broken": 0}
    assert filled.pages(filled.a) == N_A - 2 and filled.pages(filled.b) == N_B
    assert all(filled.client.exists(filled.a, filled.keys_a[:3]))


def test_evict_all_skips_leased_pages(filled):
    lease = filled.client.lookup_lease(filled.a, filled.keys_a[:3], lease_ms=60_000)
    result = admin_json(filled.address, "evict", "--all")
    assert result["pages"] == N_A + N_B - 3 and result["skipped_leased"] == 3
    assert filled.client.exists(filled.a, filled.keys_a) == [True] * 3 + [False] * (N_A - 3)
    assert filled.pages(filled.b) == 0
    filled.client.release_lease(lease)
    proc = admin(filled.address, "evict", "--all")
    assert proc.returncode == 0 and "evicted 3 pages" in proc.stdout
    assert filled.client.stats().tiers[0].pages == 0


def test_evict_of_unknown_layout_fails_clearly(shared):
    proc = admin(shared.address, "evict", "--layout", "f" * 32)
    assert_one_line_error(proc, "no layout " + "f" * 32)


# -- clear ---------------------------------------------------------------------------
def test_clear_with_yes(filled):
    proc = admin(filled.address, "clear", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert f"cleared {N_A + N_B} pages of 2 layouts" in proc.stdout
    assert filled.client.stats().tiers[0].pages == 0
    assert filled.pages(filled.a) == 0 and filled.pages(filled.b) == 0


def test_clear_without_yes_and_without_terminal_is_refused(filled):
    proc = admin(filled.address, "clear")
    assert_one_line_error(proc, "--yes")
    assert filled.client.stats().tiers[0].pages == N_A + N_B


@pytest.mark.parametrize("answer, cleared", [("n", False), ("y", True)])
def test_clear_asks_on_a_terminal(filled, answer, cleared):
    main, tty = pty.openpty()
    try:
        os.write(main, answer.encode() + b"\n")
        proc = admin(filled.address, "clear", stdin=tty)
    finally:
        os.close(tty)
        os.close(main)
    assert f"Delete all {N_A + N_B} pages" in proc.stdout
    assert proc.returncode == (0 if cleared else 1), proc.stderr
    assert filled.client.stats().tiers[0].pages == (0 if cleared else N_A + N_B)


# -- inspect -------------------------------------------------------------------------
def test_inspect_present_key(shared):
    key = shared.keys_a[0]
    proc = admin(shared.address, "inspect", "--layout", shared.a.layout_id.hex(), key.hex())
    assert proc.returncode == 0, proc.stderr
    assert "READY" in proc.stdout and "dram" in proc.stdout and "32.0 KiB" in proc.stdout
    data = admin_json(shared.address, "inspect", "--layout", shared.a.layout_id.hex()[:6],
                      key.hex())
    assert data["layout_id"] == shared.a.layout_id.hex() and data["key"] == key.hex()
    assert (data["tier"], data["state"], data["size_bytes"]) == ("dram", "READY", 32768)
    assert data["leases"] == 0 and data["age_seconds"] >= 0


def test_inspect_missing_key(shared):
    proc = admin(shared.address, "inspect", "--layout", shared.a.layout_id.hex(), "00ff")
    assert_one_line_error(proc, "NOT_FOUND", "00ff", "not stored")


# -- health and failures -------------------------------------------------------------
def test_health_serving(shared):
    proc = admin(shared.address, "health")
    assert proc.returncode == 0 and proc.stdout.strip() == "SERVING", proc.stderr


def test_health_of_dead_port():
    address = f"127.0.0.1:{free_port()}"
    assert_one_line_error(admin(address, "health"), f"cannot reach {address}")


def test_stats_of_dead_port():
    address = f"127.0.0.1:{free_port()}"
    assert_one_line_error(admin(address, "stats"), f"cannot reach {address}")


def test_a_port_past_65535_is_refused_not_wrapped(shared):
    """gRPC takes a port modulo 2**16: `clear` through host:(port + 65536) cleared the
    server at port."""
    host, port = shared.address.rsplit(":", 1)
    proc = admin(f"{host}:{int(port) + 65536}", "clear", "--yes")
    assert proc.returncode == 2 and "the port must be 1 to 65535" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert admin_json(shared.address, "stats")["tiers"][0]["pages"] > 0


def test_server_address_from_environment(shared):
    proc = admin(None, "layouts", "--json", env={"KVSTORE_SERVER": shared.address})
    assert proc.returncode == 0, proc.stderr
    assert shared.a.layout_id.hex() in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["evict", "--bytes", "12 parsecs"], "not a size"),
    (["evict", "--bytes", "0"], "above zero"),
    (["evict"], "one of the arguments"),
    (["inspect", "--layout", "xyz", "00"], "hex digits"),
    (["inspect", "--layout", "ab", "abc"], "hex digits"),
    (["stats", "--watch", "-1"], "above zero"),
    (["stats", "--watch", "1e-300"], "at least 0.1"),          # a busy loop on the server
    (["--timeout", "1e300", "stats"], "at most 86400"),         # gRPC's deadline overflowed
])
def test_bad_arguments(argv, message):
    proc = admin("127.0.0.1:1", *argv)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("text, size", [("512MiB", 512 << 20), ("4GiB", 4 << 30),
                                        ("1.5G", 1_500_000_000), ("1000", 1000), ("64kb", 64000)])
def test_parse_size(text, size):
    assert parse_size(text) == size
