"""Pipelined calls to the cluster with a deadline; every failure is a miss, never an error.

One call (exists, get, put, delete of many pages) is one pipelined batch per master:
the client routes each command to its slot's master by its own slot map (shards.py says
why glide's cluster batch could not be used: one hung master failed every call whole),
sends every master's batch at once (the first on the caller's thread, the others on a
small pool), each on a standalone glide connection of its own and with the call's
deadline, so a call costs one round trip per shard. The deadline is enforced inside
glide's Rust core, so a hung shard costs a call at most `--far-timeout` and no thread is
left waiting behind it. What it costs: three calls into glide's core and a hand-over to
two threads, where glide's cluster batch made one; docs/perf/far-4d2ee3a096.json sets
this client's exists and get against glide's own calls on a loopback cluster. Why glide
and not redis-py's cluster client: docs/far.md, "Choosing the client", renders it.

Failure, as docs/far.md promises it ("a slow or dead cluster means misses, never
errors"): a master's batch that fails whole (timeout, no connection) answers its keys
as misses and counts one error; a command that fails inside a batch (CLUSTERDOWN, MOVED
after a failover) answers its keys as misses and counts one error each, and has the
slot map asked again. Each master has its breaker (breaker.ShardBreakers); a master's
batch with any command answered is a success for it. While a master's breaker is open
its commands are answered NotAsked at once (misses), and the others are asked.

Lookups ask with one EVAL_RO per bucket (keys.py) that returns one EXISTS bit per key:
EXISTS with many keys answers only a count, and one EXISTS per key costs the client
several times more (docs/far.md renders the record). Gets send one GETRANGE per key that asks
for at most one byte more than the key's value can be (codec.value_bytes): a value
planted under a page's name is refused after that many bytes, never fetched whole (an
MGET fetches a planted value whole, however large). Why not a read-only script per
bucket that returns a value only when its STRLEN allows: the script copies each value
into Lua before replying, much slower than MGET for large pages on a loopback cluster,
where GETRANGE runs at MGET's speed. The server's reads (read) verify and copy each
value where glide's reply holds it (inplace.py).

Over 400 lines because the node connections, the slot map and the per-master breakers are
one state under one lock, which both the page calls and the namespace-wide SCAN passes
drive. Those passes (clear, clear_layouts, records: about 130 lines) are a second idea,
a walk over every master rather than one call's batches, and the next split.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import (
    Future,
    ThreadPoolExecutor,
    TimeoutError as FuturesTimeout,
    as_completed,
)
from dataclasses import dataclass
from typing import Any

import glide_sync as glide

from . import codec, inplace
from .breaker import BreakerState, FarBreaker, ShardBreakers
from .keys import (
    SLOTS,
    group_by_bucket,
    is_record,
    layout_of_name,
    namespace_pattern,
    page_key,
    record_key,
    record_pattern,
)
from .metrics import FarCounters
from .settings import ClusterMode, FarSettings
from .shards import Address, SlotMap, command_slot, parse_slots

__all__ = ["EXISTS_SCRIPT", "ClearResult", "FarClient", "NotAsked", "connect"]

log = logging.getLogger(__name__)

# One bit per key of one slot; read-only, so EVAL_RO (Redis >= 7.0, Valkey).
EXISTS_SCRIPT = ("local r = {} for i, k in ipairs(KEYS) do "
                 "r[i] = redis.call('EXISTS', k) end return r")

# Writes run behind (writer.py), off every request's path: they get a longer deadline
# than reads, enough for a batch of large pages on a busy network.
WRITE_TIMEOUT = 2.0

Commands = list[list[bytes | str]]

# Connects to one node (node given) or to the whole deployment: connect() fits.
Connect = Callable[..., object]

# A call's batches for masters other than its first run on these threads, all at once
# (the first on the caller's own): ParallelReader's 16 reads over 3 masters keep 32 of
# them busy; the rest are for writes, deletes and the slot map's refreshes.
SHARD_WORKERS = 48

# Least time between two refreshes of the slot map (shards.py): while a master hangs,
# every call to it fails and asks for one.
REFRESH_INTERVAL = 0.2

# How long an admin clear of the far tier (clear) may take on the request's path: within
# kvstore-admin's default --timeout of 5 s, so the operator gets an answer that says what
# was and was not removed; the rest goes on in the background (writer.py).
CLEAR_BUDGET = 3.0


class NotAsked(glide.RequestError):
    """A command's answer when its master was not asked: its breaker is open, another
    thread is still connecting to it, or no master serves its slot."""


@dataclass(frozen=True, slots=True)
class ClearResult:
    """What one clear removed, and the masters where it did not finish (unreachable,
    out of time, a slot moved): their pages of the pattern may still be there."""

    removed: int
    unfinished: tuple[str, ...] = ()       # "host:port" of each

    @property
    def complete(self) -> bool:
        return not self.unfinished


def _cluster_enabled(settings: FarSettings, base: dict) -> bool:
    # one address: a standalone client given several masters refuses them all
    probe = glide.GlideClient.create(glide.GlideClientConfiguration(
        **{**base, "addresses": base["addresses"][:1]}))
    try:
        info = probe.custom_command(["INFO", "cluster"])
    finally:
        probe.close()
    return b"cluster_enabled:1" in (info if isinstance(info, bytes) else str(info).encode())


def connect(settings: FarSettings, node: Address | None = None, **options):
    """A glide client: to one node when `node` is given (a standalone client: the far
    client keeps one per master, shards.py), else for the settings as a whole, cluster
    or standalone (auto: ask the first node). `options` go to glide's configuration as
    they are, but for `address_resolver`, which maps a node's announced address to the
    one to dial (tests pass a delay proxy's). Raises glide's errors when nothing answers."""
    ms = max(1, int(settings.timeout * 1000))
    resolver = options.pop("address_resolver", None) if node is not None else None
    addresses = ([node if resolver is None else resolver(*node)] if node is not None
                 else settings.nodes)
    base = dict(options, addresses=[glide.NodeAddress(h, p) for h, p in addresses],
                use_tls=settings.tls, request_timeout=ms,
                credentials=(glide.ServerCredentials(settings.password, settings.username)
                             if settings.password or settings.username else None),
                client_name="kvstore-far")
    tls = (glide.TlsAdvancedConfiguration(root_pem_cacerts=settings.ca_pem)
           if settings.tls and settings.ca_pem else None)
    base["advanced_config"] = glide.AdvancedGlideClientConfiguration(
        connection_timeout=ms, tls_config=tls)
    if node is not None:
        return glide.GlideClient.create(glide.GlideClientConfiguration(**base))
    cluster = settings.cluster is ClusterMode.ON or (
        settings.cluster is ClusterMode.AUTO and _cluster_enabled(settings, base))
    if cluster:
        return glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(
            **{**base, "advanced_config": glide.AdvancedGlideClusterClientConfiguration(
                connection_timeout=ms, tls_config=tls)}))
    return glide.GlideClient.create(glide.GlideClientConfiguration(**base))


def _nothing() -> None:
    pass


def _exec(client, commands: Commands, ms: int) -> list:
    """One non-atomic batch through glide's exec: per-command results."""
    options = (glide.ClusterBatchOptions(timeout=ms)
               if isinstance(client, glide.GlideClusterClient) else glide.BatchOptions(timeout=ms))
    return list(client.exec(inplace.make_batch(client, commands), raise_on_error=False,
                            options=options) or [])


def _free_all(frees: list[Callable[[], None]]) -> Callable[[], None]:
    if not frees:
        return _nothing
    if len(frees) == 1:
        return frees[0]

    def free() -> None:
        for f in frees:
            f()
    return free


# What a shard's batch gave: its replies or the exception that ended it, a free() for
# in-place replies, and when it started (the breaker's clock).
_ShardOutcome = tuple[list | glide.GlideError, Callable[[], None], float]


class FarClient:
    """exists / get / put / delete of one layout's pages; answers, never raises.

    Each call's commands go to their slot's master, one batch per master, all at once
    (shards.py says why); a master whose breaker is open is not asked (its keys miss)."""

    def __init__(self, settings: FarSettings, counters: FarCounters | None = None,
                 breaker: FarBreaker | ShardBreakers | None = None,
                 connect: Connect = connect) -> None:
        self.settings = settings
        self.counters = counters or FarCounters()
        self.breaker = (breaker if isinstance(breaker, ShardBreakers)
                        else ShardBreakers(breaker or FarBreaker()))
        self._connect = connect
        self._lock = threading.Lock()       # guards the fields below
        self._nodes: dict[Address, Any] = {}                # a glide client per node
        self._dialing: dict[Address, threading.Lock] = {}   # held while connecting to it
        self._map: SlotMap | None = None    # None until learned
        self._standalone = settings.cluster is ClusterMode.OFF
        self._refresh_at = 0.0              # monotonic time before which no refresh starts
        self._refreshing = False
        self._closed = False
        self._pool = ThreadPoolExecutor(SHARD_WORKERS, thread_name_prefix="kvstore-far-shard")
        # read() looks at values in glide's reply (inplace.py) where glide allows it;
        # off: it copies them out through exec, as get() does (tests compare the two).
        self.in_place = True
        self._readable_in_place = False     # whether the node clients allow it

    def _submit(self, fn: Callable, *args) -> Future:
        """fn(*args) on the pool; run here instead once the pool takes no more work
        (the interpreter is exiting: a server's graceful stop still writes its pages)."""
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError:
            done: Future = Future()
            done.set_result(fn(*args))
            return done

    # -- connections and the slot map ----------------------------------------------
    def _node(self, address: Address, wait: float):
        """The glide client of one node, connected on first use. A thread that finds
        another connecting to it waits for that at most `wait` seconds (its call's
        deadline), then answers NotAsked: a hung node costs a connect the far timeout,
        and callers must not queue behind one another for it."""
        with self._lock:
            client = self._nodes.get(address)
            if client is not None:
                return client
            if self._closed:
                raise glide.ClosingError("the far client is closed")
            dialing = self._dialing.setdefault(address, threading.Lock())
        if not dialing.acquire(timeout=max(wait, 0.0)):
            raise NotAsked(f"still connecting to {address[0]}:{address[1]}")
        try:
            with self._lock:
                client = self._nodes.get(address)
            if client is None:
                client = self._connect(self.settings, address)
                readable = inplace.supported(client)
                with self._lock:
                    first = not self._nodes
                    self._nodes[address] = client
                    self._readable_in_place = readable
                if first and self.in_place and not readable:
                    log.info("far reads copy each value out of glide's reply: this "
                             "valkey-glide-sync is not a release inplace.py reads in place")
            return client
        finally:
            dialing.release()

    def _drop(self, address: Address) -> None:
        """Forget a node's client that glide closed; the next call makes a new one."""
        with self._lock:
            client = self._nodes.pop(address, None)
        if client is not None:
            with contextlib.suppress(glide.GlideError):
                client.close()

    def _ask_slots(self, address: Address) -> SlotMap | None:
        """The slot map as one node tells it; a node without cluster support (auto) makes
        the client a standalone one, the node serving every slot."""
        ms = max(1, int(self.settings.timeout * 1000))
        replies, _, _ = self._shard_call(address, [["CLUSTER", "SLOTS"]], ms, False)
        if isinstance(replies, BaseException) or not replies:
            return None
        reply = replies[0]
        if isinstance(reply, Exception):
            if (self.settings.cluster is ClusterMode.AUTO
                    and "cluster support disabled" in str(reply)):
                self._standalone = True
                return SlotMap((0,), (SLOTS - 1,), (address,))
            return None
        found = parse_slots(reply, address)
        return found if found.owners else None

    def _discover(self) -> SlotMap | None:
        """Ask every node known (masters of the map in use whose breaker is closed first,
        then the seeds) at once; the first map that comes back wins. Within the far
        timeout (a node that has not answered by then is left to finish on its own)."""
        if self._standalone:
            found: SlotMap | None = SlotMap((0,), (SLOTS - 1,), (self.settings.nodes[0],))
        else:
            with self._lock:
                known = self._map.masters() if self._map is not None else []
            healthy = [a for a in known if self.breaker.closed(a)]
            candidates = list(dict.fromkeys([*healthy, *self.settings.nodes, *known]))
            futures = [self._submit(self._ask_slots, a) for a in candidates]
            found = None
            try:
                for future in as_completed(futures, timeout=self.settings.timeout):
                    found = future.result()
                    if found is not None:
                        break
            except FuturesTimeout:
                pass
        if found is not None:
            with self._lock:
                self._map = found
            self.breaker.masters(found.masters())
        return found

    def _slot_map(self) -> SlotMap | None:
        """The map to route by; None when the cluster's breaker holds calls back (no
        node told the map lately: the whole cluster is down) or no node tells it now.
        While that breaker is open, one call a probe interval asks again itself."""
        with self._lock:
            current = self._map
        if current is not None and self.breaker.cluster.state is BreakerState.CLOSED:
            return current
        if not self.breaker.allow():
            return None
        started = self.breaker.now()
        found = self._discover()
        if found is None:
            self.counters.add(errors=1)
        self.breaker.record(found is not None, "no node told the slot map", started)
        return found

    def _refresh_soon(self) -> None:
        """Ask for the slot map again, on a pool thread, at most every REFRESH_INTERVAL:
        a master failed or a slot moved, and the cluster may have promoted a replica."""
        now = time.monotonic()
        with self._lock:
            if (self._standalone or self._refreshing or self._closed
                    or now < self._refresh_at):
                return
            self._refreshing = True
            self._refresh_at = now + REFRESH_INTERVAL
        try:
            self._pool.submit(self._refresh)
        except RuntimeError:            # the pool was shut down: closing
            with self._lock:
                self._refreshing = False

    def _refresh(self) -> None:
        try:
            # a whole cluster down fails every refresh: that opens the cluster's breaker
            started = self.breaker.now()
            found = self._discover()
            self.breaker.record(found is not None, "no node told the slot map", started)
        finally:
            with self._lock:
                self._refreshing = False

    # -- one call: a batch per master, all at once ------------------------------------
    def _run(self, commands: Commands, timeout: float) -> list | None:
        """Run one call; per-command results (an exception for a command that failed or
        whose master was not asked), or None when no master could be named (the
        cluster's breaker is open, or no node told the slot map)."""
        out, _ = self._call(commands, timeout, in_place=False)
        return out

    def _shard_call(self, address: Address, commands: Commands, ms: int,
                    in_place: bool) -> _ShardOutcome:
        started = self.breaker.now()
        try:
            client = self._node(address, ms / 1000)
            # a connect made now spent part of the call's deadline
            left = ms - int((self.breaker.now() - started) * 1000)
            if left <= 0:
                raise glide.TimeoutError("connecting took the call's deadline")
            if in_place and self._readable_in_place:
                out, free = inplace.run(client, commands, left)
                return out, free, started
            return _exec(client, commands, left), _nothing, started
        except glide.GlideError as exc:
            return exc, _nothing, started

    def _call(self, commands: Commands, timeout: float,
              in_place: bool) -> tuple[list | None, Callable[[], None]]:
        """_run's answer and a free() to call once done with it: with in_place (and a
        glide that allows it) bulk strings are views into glide's reply until then."""
        if not commands:
            return [], _nothing
        slots = self._slot_map()
        if slots is None:
            self.counters.add(skipped=1)
            return None, _nothing
        out: list = [None] * len(commands)
        by_master: dict[Address | None, list[int]] = {}
        for i, command in enumerate(commands):
            by_master.setdefault(slots.owner(command_slot(command)), []).append(i)
        jobs: list[tuple[Address, list[int], FarBreaker]] = []
        refresh = False
        for address, idx in by_master.items():
            breaker = self.breaker.shard(address) if address is not None else None
            if address is None or breaker is None or not breaker.allow():
                self.counters.add(skipped=1)
                refresh = True          # the cluster may have promoted a replica
                why = NotAsked("breaker open" if breaker else "no master serves the slot")
                for i in idx:
                    out[i] = why
                continue
            jobs.append((address, idx, breaker))
        ms = max(1, int(timeout * 1000))
        futures = [self._submit(self._shard_call, address, [commands[i] for i in idx],
                                     ms, in_place) for address, idx, _ in jobs[1:]]
        outcomes = [self._shard_call(jobs[0][0], [commands[i] for i in jobs[0][1]], ms,
                                     in_place)] if jobs else []
        outcomes += [f.result() for f in futures]
        frees = []
        for (address, idx, breaker), (replies, free, started) in zip(jobs, outcomes, strict=False):
            frees.append(free)
            if isinstance(replies, BaseException):
                self.counters.add(errors=1)
                breaker.record(False, type(replies).__name__, started)
                for i in idx:
                    out[i] = replies
                if isinstance(replies, glide.ClosingError):
                    self._drop(address)
                refresh = refresh or not isinstance(replies, NotAsked)
                continue
            failed = 0
            for n, i in enumerate(idx):
                reply = replies[n] if n < len(replies) else NotAsked("no reply")
                out[i] = reply
                if isinstance(reply, Exception):
                    failed += 1
                    # MOVED / ASK: a slot moved (failover, resharding); CLUSTERDOWN
                    refresh = refresh or str(reply).lstrip("-").startswith(
                        ("MOVED", "ASK", "CLUSTERDOWN"))
            if failed:
                self.counters.add(errors=failed)
            breaker.record(failed < len(idx), f"{failed} of {len(idx)} commands failed",
                           started)
        if refresh:
            self._refresh_soon()
        return out, _free_all(frees)

    def exists(self, layout_id: bytes, keys: Sequence[bytes],
               timeout: float | None = None) -> list[bool]:
        """One bit per key: True when the far tier holds a value under the key's name.
        (A value still has to pass the codec when it is read.)"""
        bits, _ = self.exists_answered(layout_id, keys, timeout)
        hits = sum(bits)
        self.counters.add(hits=hits, misses=len(keys) - hits)
        return bits

    def exists_answered(self, layout_id: bytes, keys: Sequence[bytes],
                        timeout: float | None = None) -> tuple[list[bool], list[bool]]:
        """(held, answered) per key, not counted as hits or misses: answered is False
        where the key's master did not answer in time (watch.py tells "gone" from
        "not known")."""
        groups = list(group_by_bucket(self.settings.namespace, layout_id, list(keys)).values())
        out = self._run([["EVAL_RO", EXISTS_SCRIPT, str(len(g)), *(k for _, k in g)]
                         for g in groups], timeout or self.settings.timeout)
        bits = [False] * len(keys)
        answered = [False] * len(keys)
        for group, reply in zip(groups, out or (), strict=False):
            if isinstance(reply, list) and len(reply) == len(group):
                for (i, _), bit in zip(group, reply, strict=True):
                    bits[i] = bit == 1
                    answered[i] = True
        return bits, answered

    def get(self, layout_id: bytes, keys: Sequence[bytes], timeout: float | None = None,
            max_page: int = codec.MAX_PAGE) -> list[memoryview | None]:
        """Each key's page, or None: missing, unreachable, or refused by the codec."""
        pages: list[memoryview | None] = [None] * len(keys)
        self.read(layout_id, keys, timeout, pages.__setitem__, in_place=False,
                  max_page=max_page)
        return pages

    def read(self, layout_id: bytes, keys: Sequence[bytes], timeout: float | None,
             land: Callable[[int, memoryview | None], None], *,
             in_place: bool | None = None, max_page: int = codec.MAX_PAGE) -> None:
        """land(i, page) once for each key, page as get() answers it; but by default
        (in_place, see inplace.py) `page` is a view into glide's reply, valid only until
        land returns: land copies what it keeps. Of a value longer than a page of
        `max_page` bytes no more than one byte past that is fetched: refused, counted."""
        keys = list(keys)
        named = [pair for group in group_by_bucket(self.settings.namespace, layout_id,
                                                   keys).values() for pair in group]
        limits = {i: codec.value_bytes(len(keys[i]), max_page) for i, _ in named}
        # GETRANGE's end is inclusive: limit + 1 bytes at most, so "longer" shows.
        out, free = self._call([["GETRANGE", name, "0", str(limits[i])] for i, name in named],
                               timeout or self.settings.timeout,
                               self.in_place if in_place is None else in_place)
        try:
            pages: dict[int, memoryview] = {}
            nbytes = 0
            for (i, _), value in zip(named, out or (), strict=False):
                if value is None or isinstance(value, Exception) or not len(value):
                    continue            # absent (GETRANGE answers ""), or failed: counted
                if len(value) > limits[i]:
                    self.counters.reject(codec.ValueVerdict.OVERSIZED)
                    continue
                decoded = codec.decode(value, layout_id, keys[i], self.settings.keys)
                if decoded.payload is None:
                    self.counters.reject(decoded.reason)
                    continue
                pages[i] = decoded.payload
                nbytes += decoded.payload.nbytes
            self.counters.add(hits=len(pages), misses=len(keys) - len(pages),
                              bytes_read=nbytes, pages_read=len(pages))
            for i in range(len(keys)):
                land(i, pages.get(i))
        finally:
            free()

    def put(self, layout_id: bytes, items: Sequence[tuple[bytes, object]],
            timeout: float = WRITE_TIMEOUT) -> int:
        """Store (key, payload) pages; returns how many the cluster took."""
        return self.put_with_record(layout_id, items, None, timeout)[0]

    def put_with_record(self, layout_id: bytes, items: Sequence[tuple[bytes, object]],
                        record: bytes | None, timeout: float = WRITE_TIMEOUT
                        ) -> tuple[int, bool]:
        """put(), and the layout's record (records.py) in the same call when given: the
        pages stored, and whether the record was (False when none was given)."""
        ttl_ms = int(self.settings.ttl * 1000)
        expiry: list[bytes | str] = ["PX", str(ttl_ms)] if ttl_ms else []
        values = [codec.encode(layout_id, key, payload, self.settings.keys)
                  for key, payload in items]
        commands: Commands = [["SET", page_key(self.settings.namespace, layout_id, key), value,
                     *expiry] for (key, _), value in zip(items, values, strict=False)]
        if record is not None:
            commands.append(["SET", record_key(self.settings.namespace, layout_id), record,
                             *expiry])
        out = self._run(commands, timeout) or []
        stored = [len(v) - codec.HEADER_BYTES - len(key)
                  for (key, _), v, r in zip(items, values, out, strict=False) if r in ("OK", b"OK")]
        self.counters.add(pages_written=len(stored), bytes_written=sum(stored))
        return len(stored), record is not None and len(out) > len(items) and out[-1] in (
            "OK", b"OK")

    def unlink(self, layout_id: bytes, keys: Sequence[bytes],
               timeout: float = WRITE_TIMEOUT) -> tuple[int, list[bytes]]:
        """Remove pages: (how many the cluster held, the keys whose removal it did not
        confirm: their master failed, hung, moved the slot or was not asked)."""
        keys = list(keys)
        groups = list(group_by_bucket(self.settings.namespace, layout_id, keys).values())
        out = self._run([["UNLINK", *(k for _, k in g)] for g in groups], timeout)
        held, unconfirmed = 0, list[bytes]()
        for n, group in enumerate(groups):
            reply = out[n] if out is not None else None
            if isinstance(reply, int):
                held += reply
            else:
                unconfirmed.extend(keys[i] for i, _ in group)
        return held, unconfirmed

    def delete(self, layout_id: bytes, keys: Sequence[bytes],
               timeout: float = WRITE_TIMEOUT) -> int:
        """Remove pages; returns how many the cluster held (see unlink)."""
        return self.unlink(layout_id, keys, timeout)[0]

    def clear(self, layout_id: bytes | None = None, deadline: float = CLEAR_BUDGET, *,
              retry: bool = False) -> ClearResult:
        """Remove every page of this namespace (of one layout if given): on every master
        at once, SCAN for the prefix and UNLINK what it finds, for at most `deadline`
        seconds; what it removed and the masters where it did not finish. Other
        namespaces' keys are never named, so never touched. Not held back by a breaker:
        an operator's clear is worth a try, and says what it could not reach; but a
        `retry` of one in the background is, and tells the breakers how it went (else a
        hung master would hold the writer's thread for the deadline every round)."""
        return self._clear(namespace_pattern(self.settings.namespace, layout_id), None,
                           deadline, retry)

    def clear_layouts(self, layout_ids: Sequence[bytes], deadline: float = CLEAR_BUDGET, *,
                      retry: bool = False) -> ClearResult:
        """clear() of several layouts in one pass over each master (one SCAN of the
        namespace whose names are filtered here), not one pass a layout."""
        ids = frozenset(layout_ids)
        if len(ids) <= 1:
            return (self.clear(next(iter(ids)), deadline, retry=retry) if ids
                    else ClearResult(0))
        return self._clear(namespace_pattern(self.settings.namespace), ids, deadline, retry)

    def _masters(self) -> list[Address] | None:
        """Every master of the slot map, asked again if there is none; None if no node
        tells it."""
        slots = self._slot_map()
        if slots is None:
            with self._lock:
                self._map = None
            slots = self._discover()
        return None if slots is None else slots.masters()

    def _clear(self, pattern: bytes, ids: frozenset[bytes] | None, deadline: float,
               retry: bool) -> ClearResult:
        stop = time.monotonic() + deadline
        masters = self._masters()
        if masters is None:
            return ClearResult(0, ("every node (none told the slot map)",))
        done = [f.result() for f in [self._submit(self._clear_master, a, pattern, ids, stop,
                                                  retry) for a in masters]]
        return ClearResult(sum(n for n, _ in done),
                           tuple(f"{a[0]}:{a[1]}" for a, (_, ok) in zip(masters, done, strict=False)
                                 if not ok))

    def _clear_master(self, address: Address, pattern: bytes, ids: frozenset[bytes] | None,
                      stop: float, retry: bool) -> tuple[int, bool]:
        """(pages removed, finished) of one master's share of a clear."""
        breaker = self.breaker.shard(address) if retry else None
        if breaker is not None and not breaker.allow():
            return 0, False
        started = self.breaker.now()
        removed, finished = self._clear_scan(address, pattern, ids, stop)
        if breaker is not None:
            breaker.record(finished or removed > 0, "a clear did not finish", started)
        return removed, finished

    def _scan(self, address: Address, pattern: bytes, cursor: bytes | str,
              stop: float) -> tuple[bytes | str, list[bytes], int] | None:
        """One SCAN step on one master: (next cursor, names, ms left for what follows),
        or None when it failed or the time is up."""
        left = stop - time.monotonic()
        if left <= 0:
            return None
        ms = max(1, int(min(left, WRITE_TIMEOUT) * 1000))
        replies, _, _ = self._shard_call(
            address, [["SCAN", cursor, "MATCH", pattern, "COUNT", "1000"]], ms, False)
        if isinstance(replies, BaseException) or not replies or not isinstance(
                replies[0], list):
            self._refresh_soon()
            return None
        cursor, names = replies[0]
        return cursor, names, ms

    def _clear_scan(self, address: Address, pattern: bytes, ids: frozenset[bytes] | None,
                    stop: float) -> tuple[int, bool]:
        cursor: bytes | str = "0"
        removed = 0
        namespace = self.settings.namespace
        while True:
            step = self._scan(address, pattern, cursor, stop)
            if step is None:
                return removed, False
            cursor, names, ms = step
            if ids is not None:
                names = [n for n in names if layout_of_name(namespace, n) in ids]
            if names:
                replies, _, _ = self._shard_call(address, [["UNLINK", n] for n in names],
                                                 ms, False)
                if isinstance(replies, BaseException):
                    self._refresh_soon()
                    return removed, False
                # pages only: a layout's record goes with them, uncounted
                removed += sum(r for n, r in zip(names, replies, strict=False)
                               if isinstance(r, int) and not is_record(n))
                if any(isinstance(r, Exception) for r in replies):
                    self._refresh_soon()        # a slot moved: the new master's turn
                    return removed, False
            if cursor in (b"0", "0"):
                return removed, True

    # -- layout records (records.py) ---------------------------------------------------
    def records(self, deadline: float = CLEAR_BUDGET) -> tuple[list[bytes], tuple[str, ...]]:
        """Every layout record of the namespace, from every master at once within
        `deadline` s: (their values, the masters where the scan did not finish)."""
        stop = time.monotonic() + deadline
        masters = self._masters()
        if masters is None:
            return [], ("every node (none told the slot map)",)
        done = [f.result() for f in [self._submit(self._records_scan, a, stop)
                                     for a in masters]]
        return ([v for values, _ in done for v in values],
                tuple(f"{a[0]}:{a[1]}" for a, (_, ok) in zip(masters, done, strict=False) if not ok))

    def _records_scan(self, address: Address, stop: float) -> tuple[list[bytes], bool]:
        cursor: bytes | str = "0"
        values: list[bytes] = []
        pattern = record_pattern(self.settings.namespace)
        while True:
            step = self._scan(address, pattern, cursor, stop)
            if step is None:
                return values, False
            cursor, names, ms = step
            if names:
                replies, _, _ = self._shard_call(address, [["GET", n] for n in names], ms,
                                                 False)
                if isinstance(replies, BaseException) or any(
                        isinstance(r, Exception) for r in replies):
                    self._refresh_soon()
                    return values, False
                values += [bytes(r) for r in replies if r is not None]
            if cursor in (b"0", "0"):
                return values, True

    def state(self) -> BreakerState:
        """The breakers' state as the gauge shows it (ShardBreakers.state)."""
        return self.breaker.state

    def close(self) -> None:
        with self._lock:
            self._closed = True
            nodes, self._nodes = list(self._nodes.values()), {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in nodes:
            with contextlib.suppress(glide.GlideError):
                client.close()
