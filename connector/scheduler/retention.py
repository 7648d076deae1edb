"""Session retention asked for by a request: its prefix kept in the store's DRAM for a TTL.

An agent's session comes back turn after turn with a growing prefix; between turns other
traffic may evict it. A request may ask, in vLLM's `kv_transfer_params`:

    {"kvstore_retain": {"session": "agent-42", "ttl_s": 600}}
    {"kvstore_retain": {"session": "agent-42", "release": true}}     # the last turn

Once the request's pages are saved (vLLM's finished_sending for it; at once if nothing
was to be saved), the connector asks the store to retain the leading pages the request
is known to have stored (hits and saves), under that session, in every layout the engine
writes; `release` ends the session instead, after the request's own pages are saved. The
calls go on a thread of their own, never on the scheduler's loop, behind the scheduler
half's breaker (a store that does not answer is not asked), between the scheduler's steps
(quiet.StepGate: a call waits for the step under way to end), and in batches: the asks that
arrive within _LINGER_S of the first (an engine step's) go in one RetainMany a layout
(kvstore_client.KVStoreClient.retain_many), not one call a request. And only what is new:
a session comes back turn after turn with the prefix it retained before and a few pages
more, so the thread remembers, per layout and session, how many leading pages the store
keeps for it and the last one's key (keys chain: that key names the whole prefix), and
sends only the pages past them; a turn that added none sends no keys, which only moves
the session's expiry. Sending every key again cost the store a lookup and set
arithmetic per session, under its lock, beside the engine's own lookups. The store
answers how many pages the session holds after the call (`held`): fewer than sent so far
(the TTL lapsed, an admin ended it, a page was deleted) and the whole prefix is sent again
at once; a store that does not say (an older one) is always sent whole. Every ask ends counted
in RetentionCounts: retained, refused, failed, or dropped past the queue's bound. A retention the store refuses (the tenant's quota or session cap) is a
counted answer and a log line, and the request is served as ever; so is a malformed ask.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvstore_client import KVStoreError, LayoutHandle
from kvstore_client.client import Retention

from .lookups import StoreLookups
from .quiet import StepGate

__all__ = ["PARAM", "RetainAsk", "Retainer", "RetentionCounts", "ask_of"]

log = logging.getLogger(__name__)

PARAM = "kvstore_retain"        # the key in a request's kv_transfer_params
MAX_TTL_S = 86_400.0            # the store's own bound (a day)
MAX_SESSION_BYTES = 256
_QUEUED = 4096                  # asks waiting for the thread; past it they are dropped
# How long the thread lets an engine step's other asks join the first before it sends
# them, in one RetainMany a layout. One Retain a request, though off the loop, competed
# with the loop's lookups for the CPU: about twice the scheduler's admit cost with every
# request asking (`kvstore-bench admit --retain --events` runs both side by side:
# docs/perf/admit-aba30b882e.json). The wait only delays a retention, never a request.
_LINGER_S = 0.02
_SENT_KEPT = 1 << 16            # sessions remembered (past it the expired are forgotten)


@dataclasses.dataclass(slots=True)
class _Sent:
    """What the store keeps of a session in one layout, as its last answer said. Not
    frozen: a turn that adds no pages (most turns) only moves `until`, in place."""

    pages: int          # its leading pages
    last: bytes         # the key of the last of them
    until: float        # when its TTL lapses (monotonic), unless retained again


@dataclasses.dataclass(frozen=True, slots=True)
class RetainAsk:
    """What one request asked for: keep its prefix for `session`, or end the session."""

    session: str
    ttl_s: float = 0.0
    release: bool = False


@dataclasses.dataclass(slots=True)
class RetentionCounts:
    """What became of the asks since the connector started."""

    asked: int = 0          # requests that asked (retain or release)
    retained: int = 0       # retains the store kept
    pages: int = 0          # pages those retains named, summed over layouts
    refused: int = 0        # retains the store refused (quota, session cap)
    released: int = 0       # releases sent
    failed: int = 0         # calls that failed, or were not made (store not answering)
    malformed: int = 0      # asks that did not parse (ignored, the request served)
    dropped: int = 0        # asks past the queue's bound


def ask_of(params: Mapping[str, Any] | None) -> RetainAsk | None:
    """The request's ask (None: none); ValueError saying why a malformed one is ignored."""
    if not params or PARAM not in params:
        return None
    value = params[PARAM]
    if not isinstance(value, Mapping):
        raise ValueError(f"{PARAM} must be an object, got {type(value).__name__}")
    unknown = set(value) - {"session", "ttl_s", "release"}
    if unknown:
        raise ValueError(f"{PARAM}: unknown keys {sorted(unknown)}")
    session = value.get("session")
    if not isinstance(session, str) or not 0 < len(session.encode()) <= MAX_SESSION_BYTES:
        raise ValueError(f"{PARAM}: session must be a string of 1-{MAX_SESSION_BYTES} bytes")
    if value.get("release", False) is True:
        return RetainAsk(session, release=True)
    ttl = value.get("ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL_S:
        raise ValueError(f"{PARAM}: ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}]")
    return RetainAsk(session, float(ttl))


class Retainer:
    """Sends the asks of finished requests to the store, on a thread of its own."""

    def __init__(self, store: StoreLookups, gate: StepGate | None = None) -> None:
        """gate: the scheduler's steps (quiet.StepGate): calls wait for a step's end."""
        self.store = store
        self._gate = gate
        self.counts = RetentionCounts()
        self._queue: collections.deque[tuple[RetainAsk, Sequence[bytes]]] = \
            collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._closed = False
        self._busy = False
        self._warned: dict[str, float] = {}     # refusal reason -> when last logged
        # (layout id, session) -> what the store keeps of it (the thread's own)
        self._sent: dict[tuple[bytes, str], _Sent] = {}
        self._deltas = True             # False: the store does not say what it holds
        self._thread = threading.Thread(target=self._run, name="kvstore-retain", daemon=True)
        self._thread.start()

    def submit(self, ask: RetainAsk, keys: Sequence[bytes]) -> None:
        """Queue one request's ask with the keys of its stored leading pages (handed
        over, not copied: the caller changes them no more)."""
        with self._cv:
            self.counts.asked += 1
            if len(self._queue) >= _QUEUED:
                self.counts.dropped += 1
                if self.counts.dropped == 1 or not self.counts.dropped % 1000:
                    log.warning("kvstore retention: %d asks dropped so far (%d queued: the "
                                "store is slow or down)", self.counts.dropped, _QUEUED)
                return
            self._queue.append((ask, keys))
            # Only the first ask wakes the thread: it then lingers for the step's others,
            # which would each wake it again (a thread switch on the loop's time) to find
            # its linger not over.
            if len(self._queue) == 1:
                self._cv.notify()

    def malformed(self, req_id: str, exc: ValueError) -> None:
        """Count and log an ask that did not parse (the request is served as ever)."""
        with self._cv:
            self.counts.malformed += 1
        log.warning("request %s: ignoring its %s (%s)", req_id, PARAM, exc)

    def idle(self) -> bool:
        """Nothing queued or in flight (for tests and shutdown)."""
        with self._cv:
            return not self._queue and not self._busy

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                # Let the step's other asks join: one call carries them all.
                self._cv.wait_for(lambda: self._closed, _LINGER_S)
                closed = self._closed
            # Not during the scheduler's step: beside the work it planned (and without
            # our lock: the loop's asks go on queueing meanwhile).
            if self._gate is not None and not closed:
                self._gate.wait()
            with self._cv:
                batch = list(self._queue)
                self._queue.clear()
                self._busy = True
            try:
                self._send(batch)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _send(self, batch: list[tuple[RetainAsk, Sequence[bytes]]]) -> None:
        """One batch: releases one call each (rare: a session's last turn), the retains
        one RetainMany a layout. Every ask ends counted: retained, refused or failed."""
        if not self.store.breaker.allow():
            self._count(failed=len(batch))
            return
        client = self.store.client
        retains = [(ask, keys) for ask, keys in batch if not ask.release and keys]
        for ask, _ in batch:
            if ask.release:
                for (layout_id, session) in [k for k in self._sent if k[1] == ask.session]:
                    del self._sent[layout_id, session]
                try:
                    client.release_retention(ask.session)
                    self._count(released=1)
                except KVStoreError as exc:
                    self._count(failed=1)
                    log.warning("releasing session %r failed: %s", ask.session, exc)
        if not retains:
            return
        refused: dict[int, str] = {}
        pages = 0
        try:
            for handle in self.store.handles():
                pages += self._retain(handle, retains, refused)
        except KVStoreError as exc:
            self._count(failed=len(retains))
            log.warning("retaining %d sessions failed: %s", len(retains), exc)
            return
        self._count(retained=len(retains) - len(refused), refused=len(refused), pages=pages)
        for i, reason in refused.items():
            self._refused(retains[i][0].session, reason)

    def _retain(self, handle: LayoutHandle, retains: list[tuple[RetainAsk, Sequence[bytes]]],
                refused: dict[int, str]) -> int:
        """One layout's RetainMany of the asks, each sending only the pages past what the
        store keeps of its session; again with the whole prefix for those the store no
        longer keeps. Returns the pages of the prefixes retained; a refused ask's reason
        goes into `refused` (by index, the first layout's). Most asks of a steady engine
        are a session's turn that added no pages: one dict look-up and a float each."""
        now = time.monotonic()
        if len(self._sent) > _SENT_KEPT:
            self._sent = {k: v for k, v in self._sent.items() if v.until > now}
            if len(self._sent) > _SENT_KEPT:
                self._sent.clear()          # every session sent whole next time
        lid = handle.layout_id
        sent_of = self._sent
        known: list[_Sent | None] = []
        base: list[int] = []
        asks: list[tuple[str, float, Sequence[bytes]]] = []
        for ask, keys in retains:
            sent = sent_of.get((lid, ask.session))
            # What the store keeps of the session, as far as we know: its leading pages.
            b = sent.pages if (sent is not None and sent.until > now
                               and sent.pages <= len(keys)
                               and keys[sent.pages - 1] == sent.last) else 0
            known.append(sent)
            base.append(b)
            asks.append((ask.session, ask.ttl_s, keys[b:] if b else keys))
        got = self.store.client.retain_many(handle, asks)
        pages = 0
        again = []
        for i, kept in enumerate(got):
            if kept.refused:
                refused.setdefault(i, kept.refused)
            elif base[i] and kept.held < base[i] + kept.pages:
                again.append(i)             # the session lost pages: send its prefix
            else:
                pages += self._note(lid, retains[i], base[i], kept, known[i], now)
        if again:
            got = self.store.client.retain_many(
                handle, [(retains[i][0].session, retains[i][0].ttl_s, retains[i][1])
                         for i in again])
            for i, kept in zip(again, got, strict=True):
                if kept.refused:
                    refused.setdefault(i, kept.refused)
                else:
                    pages += self._note(lid, retains[i], 0, kept, None, now)
        return pages

    def _note(self, layout_id: bytes, ask_keys: tuple[RetainAsk, Sequence[bytes]],
              base: int, kept: Retention, known: _Sent | None, now: float) -> int:
        """Remember what the store keeps of the session (retained: not refused), known
        what we knew before the call; the pages of its prefix retained."""
        ask, keys = ask_keys
        pages = base + kept.pages
        if not base and kept.pages and not kept.held:
            self._deltas = False            # an older store: it does not say
        key = (layout_id, ask.session)
        if not self._deltas or not pages:
            self._sent.pop(key, None)
        elif base == pages and known is not None and self._sent.get(key) is known:
            known.until = now + ask.ttl_s   # no pages added (base: known's): expiry moved
        else:
            self._sent[key] = _Sent(pages, keys[pages - 1], now + ask.ttl_s)
        return pages

    def _count(self, **add: int) -> None:
        with self._cv:
            for name, value in add.items():
                setattr(self.counts, name, getattr(self.counts, name) + value)

    def _refused(self, session: str, reason: str) -> None:
        """One WARNING a minute per reason; the store counts every refusal too."""
        now = time.monotonic()
        if now - self._warned.get(reason, -60.0) >= 60.0:
            self._warned[reason] = now
            log.warning("the store refused to retain session %r (%s): its requests are "
                        "served, its pages evictable (%d refused so far)", session, reason,
                        self.counts.refused)

    def close(self, timeout: float) -> None:
        """Send what is queued (within timeout), then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
