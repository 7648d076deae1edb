"""Pipelined calls to the cluster with a deadline; every failure is a miss, never an error.

One call (exists, get, put, delete of many pages) is one valkey-glide batch: glide splits
it by slot owner, writes each master's commands in one go and reads the replies, so a
call costs one round trip per shard (a second after a failover, when a MOVED reply sends
a command to the slot's new owner, glide following it and refreshing its map). The
batch's `timeout` is enforced inside glide's Rust core, so a hung shard costs a call at
most `--far-timeout` and no thread is left waiting behind it. Why glide and not
redis-py's cluster client: docs/far.md, "Choosing the client", has the figures.

Failure, as DESIGN.md wants it ("a far tier that is slow or down means misses, never
errors"): a call that fails whole (timeout, no connection, cluster down) answers every
key as a miss and counts one error; a command that fails inside a batch (its shard is
down, CLUSTERDOWN, MOVED mid-failover) answers its keys as misses and counts one error
each. The breaker (breaker.py) hears about whole calls; a call with any command answered
is a success, so one dead shard among three does not stop the other two being asked.

Lookups ask with one EVAL_RO per bucket (keys.py) that returns one EXISTS bit per key:
EXISTS with many keys answers only a count, and one EXISTS per key costs the client
~2.6x more time for 4,096 keys (docs/far.md). Gets send one GETRANGE per key that asks
for at most one byte more than the key's value can be (codec.value_bytes): a value
planted under a page's name is refused after that many bytes, never fetched whole (an
MGET fetched four planted 48 MiB values for a 32 KiB page's names whole). Why not a
read-only script per bucket that returns a value only when its STRLEN allows: the
script copies each value into Lua before replying; on the 2-core development VM (3-master
loopback cluster, medians of 11, a loaded machine) 64 x 1 MiB took 256 ms through the
script against 103 ms by MGET, and GETRANGE ran at MGET's speed (313 / 318 ms, and
512 x 64 KiB 69 / 61 ms, in a more loaded run). The server's reads (read) verify and
copy each value where glide's reply holds it (inplace.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import glide_sync as glide

from . import codec, inplace
from .breaker import FarBreaker
from .keys import group_by_bucket, namespace_pattern, page_key
from .metrics import FarCounters
from .settings import ClusterMode, FarSettings

__all__ = ["EXISTS_SCRIPT", "FarClient", "connect"]

log = logging.getLogger(__name__)

# One bit per key of one slot; read-only, so EVAL_RO (Redis >= 7.0, Valkey).
EXISTS_SCRIPT = ("local r = {} for i, k in ipairs(KEYS) do "
                 "r[i] = redis.call('EXISTS', k) end return r")

# Writes run behind (writer.py), off every request's path: they get a longer deadline
# than reads, enough for a batch of large pages on a busy network.
WRITE_TIMEOUT = 2.0

Commands = list[list[bytes | str]]


def _cluster_enabled(settings: FarSettings, base: dict) -> bool:
    # one address: a standalone client given several masters refuses them all
    probe = glide.GlideClient.create(glide.GlideClientConfiguration(
        **{**base, "addresses": base["addresses"][:1]}))
    try:
        info = probe.custom_command(["INFO", "cluster"])
    finally:
        probe.close()
    return b"cluster_enabled:1" in (info if isinstance(info, bytes) else str(info).encode())


def connect(settings: FarSettings, **options):
    """A glide client for the settings: cluster or standalone (auto: ask the first node).
    `options` go to glide's configuration as they are (tests pass address_resolver).
    Raises glide's errors when nothing answers."""
    ms = max(1, int(settings.timeout * 1000))
    base = dict(options, addresses=[glide.NodeAddress(h, p) for h, p in settings.nodes],
                use_tls=settings.tls, request_timeout=ms,
                credentials=(glide.ServerCredentials(settings.password, settings.username)
                             if settings.password or settings.username else None),
                client_name="kvstore-far")
    tls = (glide.TlsAdvancedConfiguration(root_pem_cacerts=settings.ca_pem)
           if settings.tls and settings.ca_pem else None)
    base["advanced_config"] = glide.AdvancedGlideClientConfiguration(
        connection_timeout=ms, tls_config=tls)
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


class FarClient:
    """exists / get / put / delete of one layout's pages; answers, never raises."""

    def __init__(self, settings: FarSettings, counters: FarCounters | None = None,
                 breaker: FarBreaker | None = None,
                 connect: Callable[[FarSettings], object] = connect) -> None:
        self.settings = settings
        self.counters = counters or FarCounters()
        self.breaker = breaker or FarBreaker()
        self._connect = connect
        self._lock = threading.Lock()       # guards _client: made once, by one thread
        self._client = None                 # glide client; None until the first call
        # read() looks at values in glide's reply (inplace.py) where glide allows it;
        # off: it copies them out through exec, as get() does (tests compare the two).
        self.in_place = True
        self._readable_in_place = False     # whether _client allows it (inplace.supported)

    def _glide(self):
        with self._lock:
            if self._client is None:
                self._client = self._connect(self.settings)
                self._readable_in_place = inplace.supported(self._client)
                if self.in_place and not self._readable_in_place:
                    log.info("far reads copy each value out of glide's reply: this "
                             "valkey-glide-sync is not a release inplace.py reads in place")
            return self._client

    def _drop(self, client) -> None:
        """Forget a client that glide closed; the next allowed call makes a new one."""
        with self._lock:
            if self._client is client:
                self._client = None
        try:
            client.close()
        except glide.GlideError:
            pass

    def _run(self, commands: Commands, timeout: float) -> list | None:
        """Run one batch; per-command results (an exception for a failed command), or
        None when the call failed whole or was not made (breaker open)."""
        out, _ = self._call(commands, timeout, in_place=False)
        return out

    def _call(self, commands: Commands, timeout: float,
              in_place: bool) -> tuple[list | None, Callable[[], None]]:
        """_run's answer and a free() to call once done with it: with in_place (and a
        glide that allows it) bulk strings are views into glide's reply until then."""
        if not commands:
            return [], _nothing
        if not self.breaker.allow():
            self.counters.add(skipped=1)
            return None, _nothing
        client = None
        started = self.breaker.now()
        try:
            client = self._glide()
            ms = max(1, int(timeout * 1000))
            if in_place and self._readable_in_place:
                out, free = inplace.run(client, commands, ms)
            else:
                out, free = _exec(client, commands, ms), _nothing
        except glide.GlideError as exc:
            self.counters.add(errors=1)
            self.breaker.record(False, type(exc).__name__, started)
            if client is not None and isinstance(exc, glide.ClosingError):
                self._drop(client)
            return None, _nothing
        failed = sum(isinstance(r, Exception) for r in out)
        if failed:
            self.counters.add(errors=failed)
        self.breaker.record(failed < len(out), f"{failed} of {len(out)} commands failed",
                            started)
        return out, free

    def exists(self, layout_id: bytes, keys: Sequence[bytes],
               timeout: float | None = None) -> list[bool]:
        """One bit per key: True when the far tier holds a value under the key's name.
        (A value still has to pass the codec when it is read.)"""
        groups = list(group_by_bucket(self.settings.namespace, layout_id, list(keys)).values())
        out = self._run([["EVAL_RO", EXISTS_SCRIPT, str(len(g)), *(k for _, k in g)]
                         for g in groups], timeout or self.settings.timeout)
        bits = [False] * len(keys)
        for group, reply in zip(groups, out or ()):
            if isinstance(reply, list):
                for (i, _), bit in zip(group, reply):
                    bits[i] = bit == 1
        hits = sum(bits)
        self.counters.add(hits=hits, misses=len(keys) - hits)
        return bits

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
            for (i, _), value in zip(named, out or ()):
                if value is None or isinstance(value, Exception) or not len(value):
                    continue            # absent (GETRANGE answers ""), or failed: counted
                if len(value) > limits[i]:
                    self.counters.reject(codec.Reason.OVERSIZED)
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
        ttl_ms = int(self.settings.ttl * 1000)
        expiry = ["PX", str(ttl_ms)] if ttl_ms else []
        values = [codec.encode(layout_id, key, payload, self.settings.keys)
                  for key, payload in items]
        out = self._run([["SET", page_key(self.settings.namespace, layout_id, key), value,
                          *expiry] for (key, _), value in zip(items, values)], timeout)
        stored = [len(v) - codec.HEADER_BYTES - len(key)
                  for (key, _), v, r in zip(items, values, out or ()) if r in ("OK", b"OK")]
        self.counters.add(pages_written=len(stored), bytes_written=sum(stored))
        return len(stored)

    def delete(self, layout_id: bytes, keys: Sequence[bytes],
               timeout: float = WRITE_TIMEOUT) -> int:
        """Remove pages; returns how many the cluster held."""
        groups = group_by_bucket(self.settings.namespace, layout_id, list(keys)).values()
        out = self._run([["UNLINK", *(k for _, k in g)] for g in groups], timeout)
        return sum(r for r in out or () if isinstance(r, int))

    def clear(self, layout_id: bytes | None = None, deadline: float = 60.0) -> int:
        """Remove every page of this namespace (of one layout if given): SCAN for the
        prefix, UNLINK what it finds, for at most `deadline` seconds. Returns pages
        removed. Other namespaces' keys are never named, so never touched."""
        if not self.breaker.allow():
            self.counters.add(skipped=1)
            return 0
        pattern = namespace_pattern(self.settings.namespace, layout_id)
        stop = time.monotonic() + deadline
        removed = 0
        try:
            client = self._glide()
            cluster = isinstance(client, glide.GlideClusterClient)
            cursor = glide.ClusterScanCursor() if cluster else b"0"
            while time.monotonic() < stop:
                cursor, names = client.scan(cursor, match=pattern, count=1000)
                out = self._run([["UNLINK", name] for name in names], WRITE_TIMEOUT)
                removed += sum(r for r in out or () if isinstance(r, int))
                if (cursor.is_finished() if cluster else cursor in (b"0", "0")):
                    break
        except glide.GlideError as exc:
            self.counters.add(errors=1)
            self.breaker.record(False, type(exc).__name__)
        return removed

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
