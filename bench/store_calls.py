"""The store's own cost per call, in-process: what a few-key call spends in Python.

An engine's remote calls name a layer's or a block's few pages, and on a small machine a
call's latency is about the sum of both processes' CPU, so the store's Python per call
is a large part of it (docs/fastpath.md, "Per call"). Each call here runs through the
transport-neutral calls (rpc/calls.py, as both front doors do) on a Store built as the
unit tests build it, with 64 KiB pages and 16-byte keys; each figure is the median of
many timed calls. CPU in one process, so far less sensitive to the machine's load than a
round trip on the wire. The baseline in the same run is a dict lookup of the same keys
(what a store that did nothing else per key would cost).

    kvstore-bench store --calls [--rounds N]
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

from kvstore_protocol.layout import PageLayout

__all__ = ["CALLS", "per_call_us", "report_calls"]

MiB = 1 << 20
# 64 KiB pages: 32 layers, 16 tokens, 1 kv head of 32, bf16 (store_bench's "64KiB").
LAYOUT = PageLayout(model="calls", num_layers=32, page_tokens=16, num_kv_heads=1,
                    head_size=32)
# A prompt's lookup and a layer's Get of a block name more than 16 keys: "lookup 64" and
# "get 32 (few read)" (the fast path's, store/few_reads.py) measure the way such calls
# take (index.FEW_READS).
# A prompt asked for the first time mostly has only its head stored: "half" lookups name
# keys of which the first half are stored (KeyIndex.find_run).
CALLS = ("lookup 1", "lookup 16", "lookup 16 miss", "leased lookup 16 + release",
         "lookup 64", "leased lookup 64 + release", "lookup 64 half", "lookup 512",
         "lookup 512 half", "acquire 1 + release", "get 1 (calls)",
         "get 32 (few read)", "reserve 1 + commit", "put 1 (calls)",
         "reserve 16 + commit", "delete 1", "dict lookup 16 (baseline)")


def _timed(fn: Callable[[], Callable[[], object] | None], n: int) -> float:
    """Median µs of n calls of fn, each timed alone (the GC off meanwhile). fn may return
    a callable: it runs untimed after (a put's delete, so the pool never fills)."""
    times = []
    clock = time.perf_counter
    gc.disable()
    try:
        for _ in range(n):
            t0 = clock()
            after = fn()
            times.append(clock() - t0)
            if after is not None:
                after()
    finally:
        gc.enable()
    return statistics.median(times) * 1e6


def per_call_us(n: int = 2000, rounds: int = 5) -> dict[str, float]:
    """Median µs per call of each of CALLS: the median over rounds of each round's median."""
    from kvstore_server.auth import ANONYMOUS
    from kvstore_server.region import Region
    from kvstore_server.rpc.calls import Calls
    from kvstore_server.store import Store

    region = Region(256 * MiB)
    try:
        store = Store(region)
        calls = Calls(store, auth_on=False)
        who = ANONYMOUS
        client_id = LAYOUT.layout_id
        layout = calls.layout(who, client_id)
        store.register_layout(LAYOUT)
        keys = [i.to_bytes(16, "little") for i in range(1 << 20, (1 << 20) + 16)]
        data = b"".join(keys)
        one = keys[0]
        res = store.reserve(layout, keys)
        store.commit(res.lease_id)
        block = [i.to_bytes(16, "little") for i in range(1 << 21, (1 << 21) + 64)]
        res = store.reserve(layout, block)
        store.commit(res.lease_id)
        data64, data32 = b"".join(block), b"".join(block[:32])
        missing = b"".join(i.to_bytes(16, "little") for i in range(16))
        prompt = [i.to_bytes(16, "little") for i in range(1 << 22, (1 << 22) + 512)]
        for at in range(0, 512, 128):
            store.commit(store.reserve(layout, prompt[at:at + 128]).lease_id)
        absent = [i.to_bytes(16, "little") for i in range(1 << 23, (1 << 23) + 256)]
        half64 = b"".join(block[:32] + absent[:32])
        data512, half512 = b"".join(prompt), b"".join(prompt[:256] + absent)
        for packed, count in ((half64, 32), (data512, 512), (half512, 256)):
            if calls.lookup(who, [client_id], packed, 16, 0).count != count:
                raise RuntimeError(f"a lookup of {len(packed) // 16} keys did not count "
                                   f"the {count} stored")
        as_dict = {key: i for i, key in enumerate(keys)}
        fresh = iter(range(1 << 40, 1 << 41))

        # A lookup of these packed keys, and the same leased and then released.
        def lookup_of(packed: bytes) -> Callable[[], Callable[[], object] | None]:
            def call() -> Callable[[], object] | None:
                calls.lookup(who, [client_id], packed, 16, 0)
                return None
            return call

        def leased_of(packed: bytes) -> Callable[[], Callable[[], object] | None]:
            def call() -> Callable[[], object] | None:
                found = calls.lookup(who, [client_id], packed, 16, 30_000)
                calls.release(who, found.lease_id)
                return None
            return call

        def get32() -> Callable[[], object] | None:
            few = calls.get_few(who, client_id, data32, 16)
            if few is None:
                raise RuntimeError("a Get of 32 pages in DRAM did not take the few read")
            store.unpin_few(few[1])
            return None

        def acquire() -> Callable[[], object] | None:
            pinned = calls.acquire(who, client_id, one, 16, store.region.token, 30_000)
            calls.release(who, pinned.lease_id)
            return None

        def get() -> Callable[[], object] | None:
            with calls.get(who, client_id, one, 16):
                pass
            return None

        def reserve1() -> Callable[[], object] | None:
            key = next(fresh).to_bytes(16, "little")
            r = calls.reserve(who, client_id, key, 16, store.region.token, 30_000)
            calls.commit(who, r.lease_id)
            return lambda: store.delete(layout, [key])

        def put1() -> Callable[[], object] | None:
            key = next(fresh).to_bytes(16, "little")
            with calls.put(who, client_id, key, 16, LAYOUT.page_bytes) as writing:
                writing.commit()
            return lambda: store.delete(layout, [key])

        def reserve16() -> Callable[[], object] | None:
            base = next(fresh) << 8
            ks = b"".join((base + i).to_bytes(16, "little") for i in range(16))
            r = calls.reserve(who, client_id, ks, 16, store.region.token, 30_000)
            calls.commit(who, r.lease_id)
            return lambda: store.delete(layout, [ks[i:i + 16] for i in range(0, 256, 16)])

        stored: list[bytes] = []

        def store_one() -> None:
            key = next(fresh).to_bytes(16, "little")
            store.commit(store.reserve(layout, [key]).lease_id)
            stored.append(key)

        def delete1() -> Callable[[], object] | None:
            calls.delete(who, client_id, stored.pop(), 16)
            return store_one

        def baseline() -> Callable[[], object] | None:
            for key in keys:
                as_dict.get(key)
            return None

        fns = dict(zip(CALLS, (lookup_of(one), lookup_of(data), lookup_of(missing),
                               leased_of(data), lookup_of(data64), leased_of(data64),
                               lookup_of(half64), lookup_of(data512), lookup_of(half512),
                               acquire, get, get32, reserve1, put1, reserve16, delete1,
                               baseline), strict=True))
        store_one()                     # the page the first delete takes
        out: dict[str, list[float]] = {name: [] for name in CALLS}
        for _ in range(rounds):
            for name, fn in fns.items():
                out[name].append(_timed(fn, n))
        return {name: statistics.median(v) for name, v in out.items()}
    finally:
        region.close()


def report_calls(r: dict[str, float]) -> str:
    """A table of µs per call and each against the dict baseline."""
    base = r["dict lookup 16 (baseline)"]
    lines = ["| call (in-process, through rpc/calls.py) | µs per call | / dict lookup 16 |",
             "|---|---|---|"]
    lines += [f"| {name} | {us:.1f} | {us / base:.1f}x |" for name, us in r.items()]
    return "\n".join(lines)
