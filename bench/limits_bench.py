"""Limits bench: the largest requests the server takes, and larger ones, from several clients at
once; prints how much the server's RSS grew over its pool and the longest hold of the store's
lock (kvstore_store_lock_hold_seconds on /metrics).

A server with a disk tier is filled with small pages, half of them moved to disk, then C
client threads send, for `--seconds`, requests at the key limit (16,384 by default):

    lookup   16,384 keys, all on disk but the first: the tier is probed for each one
    exists   the same keys
    get      one stored key named 16,384 times (the issue's attack, at the limit)
    put      16,384 new keys of 8-byte pages
    delete   the keys just put
    over     a request past each limit: 65,537 keys, a 48 MiB message, a Get past the pool

and every answer's status is checked (refused ones must be INVALID_ARGUMENT or
RESOURCE_EXHAUSTED). RSS is sampled every 0.2 s from /proc (RssAnon: the pool is a shared
mapping, so this is what requests cost on top of it).

    kvstore-bench limits [--clients 4] [--seconds 20]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import threading
import time
import urllib.request

import grpc
import numpy as np

from kvstore_client import KVStoreClient, PageLayout
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc
from kvstore_protocol.grpc_frames import CHANNEL_OPTIONS
from kvstore_testing.serverproc import ServerProcess, free_port

__all__ = ["main"]

LAYOUT = PageLayout(model="limits-bench", num_layers=1, page_tokens=1, num_kv_heads=1,
                    head_size=4, dtype="uint8")           # 8-byte pages (K and V)
PAGE = LAYOUT.page_bytes
N = 16_384


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1)) * 1024


def packed(ks: list[bytes]) -> pb.PackedKeys:
    return pb.PackedKeys(data=b"".join(ks), key_size=len(ks[0]))


def client_loop(address: str, lid: bytes, on_disk: list[bytes], hot: bytes, seconds: float,
                seed: int, counts: dict, errors: list) -> None:
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    rng = np.random.default_rng(seed)
    end = time.monotonic() + seconds
    refused = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    while time.monotonic() < end:
        op = ("lookup", "exists", "get", "put", "over")[int(rng.integers(5))]
        try:
            if op == "lookup":
                assert stub.Lookup(pb.LookupRequest(layout_ids=[lid], keys=packed(on_disk)),
                                   timeout=60).count == N
            elif op == "exists":
                stub.Exists(pb.ExistsRequest(layout_id=lid, keys=packed(on_disk)), timeout=60)
            elif op == "get":
                n = sum(len(m.data) for m in stub.Get(pb.GetRequest(
                    layout_id=lid, keys=pb.PackedKeys(data=hot * N, key_size=len(hot))),
                    timeout=60))
                assert n == PAGE * N
            elif op == "put":
                ks = [b"p%d-%013d" % (seed, i) for i in range(N)]
                stub.Put(iter([pb.PutRequest(header=pb.PutHeader(layout_id=lid, keys=packed(ks))),
                               pb.PutRequest(data=bytes(PAGE * N))]), timeout=60)
                stub.Delete(pb.DeleteRequest(layout_id=lid, keys=packed(ks)), timeout=60)
            else:
                for request, call in (
                        (pb.LookupRequest(layout_ids=[lid], keys=pb.PackedKeys(
                            data=hot * (N + 1), key_size=len(hot))), stub.Lookup),
                        (pb.ExistsRequest(layout_id=lid, keys=pb.PackedKeys(
                            data=hot * 3_000_000, key_size=len(hot))), stub.Exists)):
                    try:
                        call(request, timeout=60)
                        errors.append(f"{op}: not refused")
                    except grpc.RpcError as err:
                        if err.code() not in refused:
                            errors.append(f"{op}: {err.code()}")
            counts[op] = counts.get(op, 0) + 1
        except (grpc.RpcError, AssertionError) as exc:
            errors.append(f"{op}: {exc!r}"[:200])
    channel.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench limits", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0)
    a = p.parse_args(argv)
    metrics_port = free_port()
    with tempfile.TemporaryDirectory() as folder, \
            ServerProcess(dram="256MiB", disk="1GiB", disk_dir=folder,
                          metrics_port=metrics_port) as srv:
        with KVStoreClient(srv.address, shared_memory=False) as c:
            ns = c.register_layout(LAYOUT)
            on_disk = [b"d-%013d" % i for i in range(N)]
            c.put(ns, on_disk, np.zeros((N, PAGE), np.uint8))
            c.evict(everything=True)                  # all to disk...
            hot = on_disk[0]
            c.get(ns, [hot])                          # ...but the first, read back
            time.sleep(2)
            base = rss_anon(srv.proc.pid)
            counts: dict = {}
            errors: list = []
            peak = base
            threads = [threading.Thread(target=client_loop, args=(
                srv.address, ns.layout_id, on_disk, hot, a.seconds, i, counts, errors))
                for i in range(a.clients)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak = max(peak, rss_anon(srv.proc.pid))
                time.sleep(0.2)
            end = rss_anon(srv.proc.pid)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    hold_max = float(re.search(r"^kvstore_store_lock_hold_max_seconds (\S+)$", text, re.M).group(1))
    buckets = re.findall(r'^kvstore_store_lock_hold_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)
    print(f"requests: {dict(sorted(counts.items()))}; {len(errors)} errors")
    for line in errors[:10]:
        print("  " + line)
    print(f"server RssAnon: {base / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB "
          f"(+{(peak - base) / 2**20:.0f} MiB), end {end / 2**20:.0f} MiB, with "
          f"{a.clients} clients sending requests at the limits")
    print(f"store lock: longest hold {hold_max * 1e3:.1f} ms; holds by bucket (cumulative): "
          + ", ".join(f"<={b}s: {float(n):.0f}" for b, n in buckets))
    return 1 if errors else 0
