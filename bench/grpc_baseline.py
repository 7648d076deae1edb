"""What Python gRPC itself moves: a server stream of prebuilt 1 MiB messages, no store.

The store's Get is a server stream of ~1 MiB messages too, so this is a reference for
it: the server yields the same bytes object every time (no gather from a pool) and the
client copies each message into a buffer it owns, as get_into must. A Get close to this
figure spends its time in gRPC, not in the store. The calling process should have called
kvstore_protocol.malloc.keep_freed_buffers() first, as a gRPC reader of pages should:
without it this stream was slower than the store's Get (which ran after that call) in
the same runs.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from concurrent import futures

import grpc
import numpy as np

from kvstore_protocol.grpc_frames import CHANNEL_OPTIONS
from kvstore_protocol.malloc import keep_freed_buffers

MiB = 1 << 20
_METHOD = "/bench.Baseline/Stream"


def _serve(port_q, message_bytes: int) -> None:
    keep_freed_buffers()                # as the daemon does
    message = bytes(message_bytes)

    def stream(request: bytes, context):
        for _ in range(int.from_bytes(request, "little")):
            yield message

    handler = grpc.method_handlers_generic_handler("bench.Baseline", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def grpc_stream_gbps(total: int, reps: int, message_bytes: int = MiB) -> float:
    """Median GB/s of `total` bytes as a stream of message_bytes messages, each copied
    into the client's buffer; the server in another process."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_serve, args=(q, message_bytes), daemon=True)
    server.start()
    try:
        port = q.get(timeout=60)
        out = np.ones(total, dtype=np.uint8)
        count = total // message_bytes
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            call = channel.unary_stream(_METHOD)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                pos = 0
                for message in call(count.to_bytes(4, "little"), timeout=120):
                    out[pos:pos + len(message)] = np.frombuffer(message, dtype=np.uint8)
                    pos += len(message)
                times.append(time.perf_counter() - t0)
        return count * message_bytes / statistics.median(times) / 1e9
    finally:
        server.kill()
        server.join(10)
