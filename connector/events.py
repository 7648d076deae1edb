"""KV events for a router: what the store holds of this engine's prefixes, stored and removed.

A KV-aware router (llm-d's indexer, Dynamo's router) reads each engine's KV-event stream
to learn which prefixes are cheap where. vLLM publishes its own GPU blocks; the connector
adds what the store holds for the engine, in the engine's own block hashes, so the router
needs no code of ours:

    request_finished ──► saved(run): the request's stored pages (hits and saves), with the
        │                 engine's block hashes of each page; queued, nothing else on the
        │                 scheduler's loop
        ▼
    poll thread, every `interval` s, between two of the scheduler's steps (quiet.StepGate):
        1. the store's removal ring (kvstore_server.removals) after our cursor: a page we
           announced that left any of our layouts ──► Removed(its hashes); a whole layout
           (invalidation, clear) or a gap (the ring overwrote what we had not read, or the
           store restarted) ──► Removed for every page we announced
        2. the runs queued: Exists in every layout; the pages held everywhere and not
           announced yet ──► Stored(hashes, parent, tokens)
        ▼
    take() on the scheduler's loop: the events so far, in order (vLLM's take_events)

Removals come first in a poll, then stores: a page evicted before its Exists answers is
not announced; one evicted after is in the next poll's removals. So a router learns a
store or a removal within one interval (+ one call) of the store's, and never hears of a
page as held after its removal was read. Bounded: at most `max_tracked` announced pages
are remembered (past it the oldest is announced removed: the router under-estimates,
never over-), and `_QUEUED` runs wait for their Exists (past it a run is not announced).

Engine-agnostic: the vLLM adapter turns Stored/Removed into vLLM's BlockStored/
BlockRemoved. Thread-safe: saved() and take() from the engine's loop, the rest on the
poll thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from kvstore_client import KVStoreClient, KVStoreError, LayoutHandle, PageLayout

from .eventruns import PackedRun, token_tuple
from .scheduler.quiet import StepGate

__all__ = ["EventCounts", "EventFeed", "Removed", "SavedRun", "Stored"]

log = logging.getLogger(__name__)

DEFAULT_TRACKED = 1 << 18       # announced pages remembered (~150 bytes each)
_QUEUED = 4096                  # saved runs waiting for their Exists
_LOG_EVERY_S = 60.0             # at most one log line a minute for a failing poll

BlockHash = Hashable            # the engine's hash of one block (vLLM: an int once exported)
ExtraKeys = tuple[Any, ...] | None      # what besides tokens a block's hash covers (or none)


@dataclasses.dataclass(frozen=True, slots=True)
class SavedRun:
    """A request's leading pages in the store: keys[i] is page i's key; hashes are the
    engine's block hashes from the prompt's start (blocks_per_page a page) and tokens its
    token ids (page_tokens a page): best the int32 array the scheduler half holds
    (SchedulerHalf.stored_tokens), which the GC does not walk while the run waits
    (connector.eventruns). Not copied: the poll thread slices them. extra: for a
    request whose block hashes cover more than its tokens (multimodal inputs, a cache
    salt, a LoRA), the extra keys of its blocks [start, end), one entry a block, made on
    the poll thread only for the blocks announced; None for the rest."""

    keys: Sequence[bytes]
    hashes: Sequence[BlockHash]
    tokens: Sequence[int] | np.ndarray
    blocks_per_page: int
    page_tokens: int
    lora_name: str | None = None
    extra: Callable[[int, int], Sequence[ExtraKeys]] | None = None

    def page_hashes(self, i: int) -> tuple[BlockHash, ...]:
        return tuple(self.hashes[i * self.blocks_per_page:(i + 1) * self.blocks_per_page])


@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    """Pages now held by the store: their blocks' hashes in order, after `parent`."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    tokens: tuple[int, ...]
    lora_name: str | None = None
    extra_keys: tuple[ExtraKeys, ...] | None = None     # one a block; None: no block has


@dataclasses.dataclass(frozen=True, slots=True)
class Removed:
    """Pages the store no longer holds: their blocks' hashes."""

    hashes: tuple[BlockHash, ...]


@dataclasses.dataclass(slots=True)
class EventCounts:
    """What the feed did since start."""

    stored: int = 0         # pages announced stored
    removed: int = 0        # pages announced removed
    gaps: int = 0           # reads that found a gap (every page announced removed)
    polls: int = 0
    failed: int = 0         # polls that failed (store down, refused): retried next poll
    dropped: int = 0        # runs not announced: past the queue's bound
    forgotten: int = 0      # pages announced removed to stay within max_tracked


class EventFeed:
    """Stored and removed pages of one engine's layouts, from the store, for its events."""

    def __init__(self, client: KVStoreClient, layouts: Sequence[PageLayout], *,
                 interval: float = 0.5, max_tracked: int = DEFAULT_TRACKED,
                 clock: Callable[[], float] = time.monotonic,
                 gate: StepGate | None = None) -> None:
        """layouts: every layout whose pages make up what the engine loads (each rank,
        each group); a page counts as held while all of them hold it. interval: seconds
        between polls. gate: the scheduler's steps (connector.scheduler.quiet): a poll
        waits for the step under way to end."""
        self.client = client
        self._gate = gate
        self.layouts = list(layouts)
        self.interval = interval
        self.max_tracked = max_tracked
        self.counts = EventCounts()
        self._clock = clock
        self._handles: list[LayoutHandle] | None = None
        self._epoch = 0                 # the ring's epoch and our cursor in it
        self._seq = 0
        self._runs: collections.deque[PackedRun] = collections.deque()  # guarded by _cv
        self._out: list[Stored | Removed] = []                          # guarded by _cv
        # key -> its page's block hashes, oldest announced first (poll thread only).
        self._held: collections.OrderedDict[bytes, tuple[BlockHash, ...]] = \
            collections.OrderedDict()
        self._cv = threading.Condition()
        self._closed = False
        self._last_log = -_LOG_EVERY_S
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    # -- the engine's loop ------------------------------------------------------------
    def saved(self, run: SavedRun) -> None:
        """Queue a request's stored pages, to announce once the store confirms them."""
        if not run.keys:
            return
        packed = PackedRun.of(run)
        with self._cv:
            if len(self._runs) >= _QUEUED:
                self.counts.dropped += 1
                return
            self._runs.append(packed)

    def take(self) -> list[Stored | Removed]:
        """The events since the last call, in order."""
        with self._cv:
            out, self._out = self._out, []
        return out

    def poll_now(self, timeout: float = 10.0) -> None:
        """Run one poll at once and wait for it (tests, shutdown)."""
        with self._cv:
            target = self.counts.polls + 2       # one may be under way: wait a whole one
            self._cv.notify_all()
            deadline = time.monotonic() + timeout
            while self.counts.polls < target and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the KV-event poll did not finish")
                self._cv.notify_all()
                self._cv.wait(min(left, 0.05))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=self.interval + 5.0)

    # -- the poll thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
            if self._gate is not None:
                self._gate.wait()           # beside the engine's forward, not its step
            try:
                self._poll()
            except KVStoreError as exc:
                self._failed(exc)
            except Exception as exc:  # noqa: BLE001 - the engine must outlive its event feed
                self._failed(exc)
            with self._cv:
                self.counts.polls += 1
                self._cv.notify_all()
                if not self._closed:
                    self._cv.wait(self.interval)

    def _failed(self, exc: Exception) -> None:
        with self._cv:
            self.counts.failed += 1
        self._handles = None            # registered again next time (a restarted store)
        now = self._clock()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("kvstore KV events: polling the store failed (%s); retrying every "
                        "%.1f s", exc, self.interval)

    def _poll(self) -> None:
        if self._handles is None:
            self._handles = [self.client.register_layout(lay) for lay in self.layouts]
        if self._epoch == 0:
            start = self.client.removals(self._handles)
            self._epoch, self._seq = start.epoch, start.next_seq
        out: list[Stored | Removed] = []
        self._read_removals(out)
        self._confirm_runs(out)
        if out:
            with self._cv:
                self._out += out

    def _read_removals(self, out: list[Stored | Removed]) -> None:
        assert self._handles is not None
        while True:
            got = self.client.removals(self._handles, self._seq, self._epoch)
            if got.gap:
                self.counts.gaps += 1
                self._remove(list(self._held), out)
            gone: list[bytes] = []
            for entry in got.entries:
                if not entry.key:       # every page of a layout: all we announced
                    gone = list(self._held)
                    break
                gone.append(entry.key)
            self._remove(gone, out)
            self._epoch, self._seq = got.epoch, got.next_seq
            if not got.more:
                return

    def _remove(self, keys: Sequence[bytes], out: list[Stored | Removed]) -> None:
        hashes: list[BlockHash] = []
        for key in keys:
            page = self._held.pop(key, None)
            if page is not None:
                hashes += page
                self.counts.removed += 1
        if hashes:
            out.append(Removed(tuple(hashes)))

    def _confirm_runs(self, out: list[Stored | Removed]) -> None:
        with self._cv:
            queued, self._runs = list(self._runs), collections.deque()
        runs = self._news(queued)
        if not runs:
            return
        assert self._handles is not None
        keys = list(dict.fromkeys(k for run in runs for k in run.keys
                                  if k not in self._held))
        held = np.ones(len(keys), dtype=bool)
        for handle in self._handles:
            if keys:
                held &= np.array(self.client.exists(handle, keys), dtype=bool)
        present = {k for k, ok in zip(keys, held.tolist(), strict=True) if ok}
        for run in runs:
            self._announce(run, present, out)
        over = len(self._held) - self.max_tracked
        if over > 0:
            oldest = list(itertools.islice(self._held, over))
            self.counts.forgotten += len(oldest)
            self._remove(oldest, out)

    def _news(self, runs: list[PackedRun]) -> list[SavedRun]:
        """The runs that may announce a page: not those whose pages are all announced
        (a session's next turn, a shared system prompt), nor those that repeat a run
        before them in the poll (requests of one prompt: the same keys, no more pages
        hashed): the first announces what it could. Only these are unpacked."""
        contains = self._held.__contains__
        first: dict[tuple[int, Hashable], tuple[PackedRun, int]] = {}
        out = []
        for run in runs:
            tag = run.tag
            seen = first.get(tag)
            if seen is None:
                first[tag] = (run, run.whole())
            elif seen[0].same_keys(run) and run.whole() <= seen[1]:
                continue
            keys = run.key_list()
            # all() over map(): no frame of ours per key, and it stops at the first new.
            if not all(map(contains, keys)):
                out.append(SavedRun(keys, run.hash_list(), run.tokens, run.blocks_per_page,
                                    run.page_tokens, run.lora_name, run.extra))
        return out

    @staticmethod
    def _whole(run: SavedRun) -> int:
        """The run's leading pages it can announce: those the engine has hashed."""
        return min(len(run.keys), len(run.hashes) // max(1, run.blocks_per_page),
                   len(run.tokens) // max(1, run.page_tokens))

    def _announce(self, run: SavedRun, present: set[bytes],
                  out: list[Stored | Removed]) -> None:
        """Stored events for the run's pages held now and not yet announced: one per
        stretch of consecutive pages, each after the block before it. A page whose
        blocks the engine has not all hashed is not announced."""
        whole = self._whole(run)
        stretch: list[int] = []
        for i, key in enumerate(run.keys[:whole]):
            if key in present and key not in self._held:
                stretch.append(i)
                continue
            self._stored(run, stretch, out)
            stretch = []
        self._stored(run, stretch, out)

    def _stored(self, run: SavedRun, pages: list[int], out: list[Stored | Removed]) -> None:
        if not pages:
            return
        first, last = pages[0], pages[-1]
        per = run.blocks_per_page
        parent = run.hashes[first * per - 1] if first else None
        hashes = tuple(run.hashes[first * per:(last + 1) * per])
        tokens = token_tuple(run.tokens, first * run.page_tokens,
                             (last + 1) * run.page_tokens)
        extra = None
        if run.extra is not None:
            extra = tuple(run.extra(first * per, (last + 1) * per))
            extra = extra if any(k is not None for k in extra) else None
        for i in pages:
            self._held[run.keys[i]] = run.page_hashes(i)
        self.counts.stored += len(pages)
        out.append(Stored(hashes, parent, tokens, run.lora_name, extra))
