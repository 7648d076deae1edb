"""What TLS costs the fast path: one plain server and one TLS server side by side, one run.

`kvstore-bench fastpath --tls` starts both (the TLS one with a throwaway self-signed
certificate made by the openssl command, serving TLS on its gRPC and its fast-path TCP
port) and measures, per run and on each in turn: get and put of 1 MiB pages over one
fast-path connection and striped over four, and one 64 KiB page get p50. Both servers
run at once on the same machine, so the ratios of one run compare like with like.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import grpc
import numpy as np

from kvstore_client import KVStoreClient
from kvstore_client.buffers import page_aligned_empty
from kvstore_testing.serverproc import ServerProcess

from .fastpath_pages import PAGE_1M, PAGE_64K, percentile_us, timed
from .store_bench import put_get_gbps

__all__ = ["tls_report"]

MiB = 1 << 20


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """cert.pem and key.pem for 127.0.0.1; the certificate is its own CA."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "1", "-subj", "/CN=kvstore-bench",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=folder, check=True, capture_output=True, timeout=60)
    return folder / "cert.pem", folder / "key.pem"


def _measure(address: str, tls_ca: str | None, total: int, reps: int, iters: int,
             tag: str) -> dict:
    r = {}
    for conns in (1, 4):
        with KVStoreClient(address, timeout=120, shared_memory=False, data_plane=True,
                           data_connections=conns, tls_ca=tls_ca) as c:
            put, get = put_get_gbps(c, c.register_layout(PAGE_1M), total, reps,
                                    f"{tag}-{conns}")
            r[f"get_x{conns}"], r[f"put_x{conns}"] = get, put
    with KVStoreClient(address, shared_memory=False, data_plane=True, tls_ca=tls_ca) as c:
        ns = c.register_layout(PAGE_64K)
        key = [f"tls-{tag}".encode().ljust(16, b".")]
        page = np.random.default_rng(2).integers(0, 256, (1, ns.page_bytes), dtype=np.uint8)
        c.put(ns, key, page)
        out = page_aligned_empty((1, ns.page_bytes))
        c.get_into(ns, key, out)
        if not np.array_equal(out, page):
            raise SystemExit(f"{tag}: the 64 KiB page came back different")
        r["get64k_p50_us"] = percentile_us(timed(lambda: c.get_into(ns, key, out), iters), .5)
        c.delete(ns, key)
    return r


ROWS = [("get_x1", "get 1 MiB pages, 1 connection, GB/s"),
        ("get_x4", "get 1 MiB pages, 4 connections, GB/s"),
        ("put_x1", "put 1 MiB pages, 1 connection, GB/s"),
        ("get64k_p50_us", "one 64 KiB page p50 us")]


def tls_report(runs: int, mib: int, iters: int = 500) -> str:
    if shutil.which("openssl") is None:
        return "SKIPPED: the TLS comparison needs the openssl command to make a certificate"
    total = mib * MiB
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = _self_signed(Path(tmp))
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        dram = f"{max(256, 3 * mib)}MiB"
        with ServerProcess(dram=dram, data_socket="false").start(wait=120) as plain, \
                ServerProcess(dram=dram, data_socket="false", tls_cert=cert, tls_key=key,
                              credentials=creds).start(wait=120) as tls:
            results = []
            for i in range(runs):
                results.append({
                    "plain": _measure(plain.address, None, total, 3, iters, f"plain-{i}"),
                    "tls": _measure(tls.address, str(cert), total, 3, iters, f"tls-{i}")})
    lines = [f"fast path over TCP with and without TLS, two servers side by side, {mib} MiB "
             f"a call, medians of {runs} runs", "",
             "| | plain | TLS | TLS / plain (per run) |", "|---|---|---|---|"]
    for field, label in ROWS:
        plain_ = statistics.median(r["plain"][field] for r in results)
        tls_ = statistics.median(r["tls"][field] for r in results)
        ratios = ", ".join(f"{r['tls'][field] / r['plain'][field]:.2f}" for r in results)
        fmt = "{:.0f}" if field.endswith("us") else "{:.2f}"
        lines.append(f"| {label} | {fmt.format(plain_)} | {fmt.format(tls_)} | {ratios} |")
    return "\n".join(lines)
