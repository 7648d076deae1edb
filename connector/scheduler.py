"""The scheduler half: how much of a prompt the store holds, and what to load and save.

It runs beside the engine's scheduler and never touches tensors. Per request:

    hit(req, tokens, local)   -> external tokens to load (page-aligned, beyond the
                                 engine's own prefix cache), None = "ask again", leasing
                                 the counted pages so they cannot vanish before the load
    allocated(req, blocks, n) -> a LoadSpec for the next step's metadata
    scheduled(req, ...)       -> SaveSpecs for pages this step completes
    build()                   -> the StepMeta for the workers (and forget it)
    load_finished / load_failed_blocks / finished(req) -> leases released, state dropped

Why a load stays "unconfirmed" for a while, and what that guards. A layer-wise load planned
in one build runs in that step's forward; under vLLM's AsyncScheduler the next step is
planned (and, in the same process, sent to the workers) before that forward has even
started, so the scheduler learns whether the load succeeded only `lag` builds later
(vLLM's max_concurrent_batches: 1 for Scheduler, 2 for AsyncScheduler). Until then:
  - the lookup lease stays held, so the pages cannot be evicted before the worker has
    pinned them itself (Acquire);
  - every page saved by a request whose prefix reads the load's blocks (the request
    itself, or another one that shares them through the engine's prefix cache) names the
    load in SaveSpec.after; the workers commit it only once a later plan reports the
    load good (StepMeta.loads_ok) and drop it if the load failed on any rank
    (StepMeta.loads_failed).
A failed load marks its request so that the pages it recomputes are saved, and marks
every other request that read the failed blocks as tainted: it saves nothing more,
whatever restart point the engine picks for it (docs/vllm-load-failure-sharing.md).

Where the lookups run (ConnectorConfig.lookups). "sync": on the caller's thread, one
Lookup per request as the engine asks. "prefetch" (the default): a request seen for the
first time is handed to a worker thread (connector.prefetch) that hashes it and looks it
up; the caller waits for that answer only while the step's lookup_wait_ms lasts, else
hears "ask again". A later ask takes the answer if it has come, else hears "ask again"
while the worker gets through its queue, up to lookup_timeout after the first ask (then
"no hit"). An ask that finds the worker's call in flight past lookup_wait_ms (at least
2 ms: the store may hang) waits for its answer until that deadline instead, so a hung
store costs one step one timeout and then opens the breaker. Lease releases go through the
same worker. A prefetched answer is dropped, and its lease released, when the request
finishes first, or when its tokens changed before the answer was taken (it counted
pages of other tokens); a lease is released on every path.

A store that does not answer costs the step that meets it at most one lookup_timeout;
then the breaker is open (connector.breaker) and no step asks the store anything (no hit,
no wait, lease releases kept) until its background probe finds the store answering. A
request hears "ask again" at most `ask_again` times after a timeout (sync lookups).

Keys are the connector's chained page hashes (connector.hashing), computed once per page
and extended as a request grows. With tensor parallelism every rank has its own layout;
the hit is asked over all of them in one Lookup, which answers the minimum, so ranks
never disagree about what to load.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import grpc
import numpy as np

from kvstore_client import KVStoreClient, KVStoreError, LayoutHandle, PageLayout
from kvstore_client.keys import Packed

from .breaker import Breaker
from .config import ConnectorConfig, LookupMode, SavePolicy, open_client
from .hashing import KEY_BYTES, page_keys
from .meta import LoadSpec, SaveSpec, StepMeta
from .prefetch import DOWN, Answer, Job, LookupWorker, Pending

__all__ = ["SchedulerHalf"]

log = logging.getLogger(__name__)

_RELEASES_KEPT = 100_000      # lease releases waiting for a store that does not answer
# A prefetched lookup in flight for longer than this (or lookup_wait_ms, if longer) may be
# meeting a hung store: a healthy one takes ~0.25 ms on the dev VM.
_STALLED_S = 0.002
# Errors after which the store counts as unreachable: no hit, one warning, no failure.
_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclasses.dataclass(slots=True)
class _Request:
    tokens: np.ndarray                     # int32 token ids known so far
    prompt_len: int
    keys: list[bytes] = dataclasses.field(default_factory=list)  # keys of full pages
    packed: bytes = b""                    # the same keys back to back, for lookups
    block_ids: list[int] = dataclasses.field(default_factory=list)
    local_tokens: int = 0                  # the engine's own prefix-cache hit
    lease_id: int = 0                      # pins the counted pages until allocated
    saved_pages: int = 0                   # leading pages known stored (hit or saved)
    load_failed: bool = False              # its own load failed: recompute, no new hit
    tainted: bool = False                  # read blocks of another's failed load
    asked_again: int = 0                   # "ask again" answers given so far


@dataclasses.dataclass(slots=True)
class _Load:
    """A load handed to the workers whose outcome is not known yet."""

    req_id: str
    first_page: int                        # the request's page the load starts at
    blocks: frozenset[int]
    lease_id: int                          # the lookup lease, held until confirmed
    confirm_at: int | None                 # build number that confirms it; None: async


class SchedulerHalf:
    """Engine-agnostic scheduler logic; adapters translate engine objects into calls."""

    def __init__(self, config: ConnectorConfig, layouts: Sequence[PageLayout], block_size: int,
                 client: KVStoreClient | None = None, *, lag: int = 1) -> None:
        """lag: how many builds later a step's outcome is known (the engine's number of
        batches in flight: vLLM's max_concurrent_batches)."""
        if not layouts:
            raise ValueError("the scheduler half needs at least one layout (one per rank)")
        self.config = config
        self.page_tokens = layouts[0].page_tokens
        if self.page_tokens % block_size:
            raise ValueError(f"page_tokens {self.page_tokens} must be a multiple of the "
                             f"engine's block size {block_size}")
        self.block_size = block_size
        self.blocks_per_page = self.page_tokens // block_size
        self.layouts = list(layouts)
        self.seed = layouts[0].chain_seed
        # The scheduler only asks and leases: no page bytes, so no shared memory; and a
        # lookup must answer within lookup_timeout, so no retries either.
        self.client = client or open_client(config, config.lookup_timeout, retries=0,
                                            shared_memory=False)
        self._handles: list[LayoutHandle] | None = None
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._leases_to_release: list[int] = []
        self._down_since = 0.0        # when the store was last found unreachable
        self.breaker = Breaker(config.probe_interval, self._probe)
        self.lag = max(1, lag)
        self._builds = 0              # builds so far: the clock of _Load.confirm_at
        self._next_load_id = 1
        self._unconfirmed: dict[int, _Load] = {}    # load id -> load not yet confirmed
        self._ok: list[int] = []          # loads settled since the last build: good,
        self._failed: list[int] = []      # ... and failed (StepMeta.loads_ok/_failed)
        # Prefetched lookups (LookupMode.PREFETCH): the worker, the answers not yet taken
        # (by request id), and the seconds this step has waited for first answers.
        self._worker = (LookupWorker(self._lookup_job, self._send_releases)
                        if config.lookups is LookupMode.PREFETCH else None)
        self._pending: dict[str, Pending] = {}
        self._waited = 0.0

    # -- the store ----------------------------------------------------------------------
    def _prefetcher(self) -> LookupWorker:
        """The lookup worker (only called in LookupMode.PREFETCH, where it exists)."""
        assert self._worker is not None
        return self._worker

    def _ns(self) -> list[LayoutHandle]:
        if self._handles is None:
            self._handles = [self.client.register_layout(layout) for layout in self.layouts]
        return self._handles

    def _probe(self) -> bool:
        """The breaker's probe (on its own thread): does the store answer? Registering
        the layouts is idempotent, and after a restart it is what the store needs first."""
        try:
            self._handles = [self.client.register_layout(layout) for layout in self.layouts]
        except KVStoreError as exc:
            return exc.code != grpc.StatusCode.DEADLINE_EXCEEDED and exc.code not in _DOWN
        return True

    def _store_down(self, exc: Exception) -> None:
        now = time.monotonic()
        if self.breaker.failed() and now - self._down_since > 60:
            log.warning("kvstore at %s not answering (%s): serving without it, probing "
                        "every %.1f s", self.config.server, exc, self.config.probe_interval)
        self._down_since = now

    # -- requests -----------------------------------------------------------------------
    def _state(self, req_id: str, tokens, prompt_len: int | None = None, *,
               convert: bool = True) -> _Request:
        """The request's state; convert=False leaves a new request's tokens unconverted
        (the lookup worker converts them off the loop)."""
        state = self._requests.get(req_id)
        # Converting a 32k-token list costs milliseconds (2,176 tokens: ~40 us): only
        # when the request grew.
        if state is None:
            arr = np.asarray(tokens, dtype=np.int32) if convert else np.zeros(0, np.int32)
            state = _Request(arr, len(tokens) if prompt_len is None else prompt_len)
            self._requests[req_id] = state
        elif len(tokens) > len(state.tokens) and convert:
            state.tokens = np.asarray(tokens, dtype=np.int32)
        return state

    def _keys_upto(self, state: _Request, pages: int) -> list[bytes]:
        """Keys of the first `pages` pages, hashing only pages not hashed before."""
        have = len(state.keys)
        if pages > have:
            t = self.page_tokens
            parent = state.keys[-1] if state.keys else None
            new = page_keys(state.tokens[have * t:pages * t], t, self.seed, parent=parent)
            state.keys += new
            state.packed += b"".join(new)
        return state.keys[:pages]

    def hit(self, req_id: str, tokens, num_local_tokens: int) -> int | None:
        """Tokens to load beyond the engine's own `num_local_tokens`; None = ask again."""
        if not self.config.role.loads:
            return 0
        prefetch = self._worker is not None
        state = self._state(req_id, tokens, convert=not prefetch)
        state.local_tokens = num_local_tokens
        # A lease from an earlier answer that was not acted on (the engine could not
        # allocate blocks, or asks again after a preemption) pins pages for nothing:
        # every answer starts by dropping it, whichever way it returns.
        self._drop_lease(state)
        if state.load_failed or state.tainted:
            self._abandon(req_id)
            return 0          # a failed load is recomputed, not retried in a loop
        t = self.page_tokens
        # Never claim the whole prompt: the engine must compute at least its last token.
        usable = (len(tokens) - 1) // t
        if usable * t <= num_local_tokens or num_local_tokens % t:
            # Nothing beyond the local hit, or a local hit that ends inside a page (only
            # possible when a page spans several blocks): loading would overwrite blocks
            # the engine already shares, so recompute instead.
            self._abandon(req_id)
            return 0
        if prefetch:
            return self._hit_prefetched(req_id, state, tokens, usable)
        self._keys_upto(state, usable)
        # The keys go packed, as one bytes object kept per request: a 32k-token prompt's
        # 2,048 keys are not checked and joined again on every lookup.
        keys = Packed(state.packed[:usable * KEY_BYTES], KEY_BYTES)
        if not self.breaker.allow():
            return 0          # the store is not answering: no hit, no wait
        try:
            count, lease_id = self._ask(keys)
        except KVStoreError as exc:
            if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED and exc.code not in _DOWN:
                raise
            self._store_down(exc)
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED \
                    and state.asked_again < self.config.ask_again:
                state.asked_again += 1
                return None   # maybe a moment's stall: the engine asks again next step
            return 0
        self.breaker.succeeded()
        return self._counted(state, count, lease_id)

    def _ask(self, keys: Packed) -> tuple[int, int]:
        """(leading pages present in every rank's layout, lease id or 0): one Lookup."""
        if self.config.lease_ms:
            lease = self.client.lookup_lease(self._ns(), keys, self.config.lease_ms)
            return lease.count, lease.lease_id
        return self.client.lookup(self._ns(), keys), 0

    def _counted(self, state: _Request, count: int, lease_id: int) -> int:
        """The store holds `count` leading pages (leased by lease_id): the hit to report."""
        state.lease_id = lease_id
        state.saved_pages = max(state.saved_pages, count)
        first = state.local_tokens // self.page_tokens
        hit = (count - first) * self.page_tokens
        if hit <= 0 or hit < self.config.min_hit_tokens:
            self._drop_lease(state)       # too short to be worth loading: recompute
            return 0
        return hit

    # -- prefetched lookups (LookupMode.PREFETCH) -----------------------------------------
    def _hit_prefetched(self, req_id: str, state: _Request, tokens, usable: int) -> int | None:
        pending = self._pending.get(req_id)
        if pending is not None and (pending.job.pages != usable
                                    or len(pending.job.tokens) != len(tokens)):
            self._abandon(req_id)         # asked for other tokens: its count is not ours
            pending = None
        if pending is None:
            if not self.breaker.allow():
                return 0                  # the store is not answering: no hit, no wait
            # A slice, not the list: the engine may append to it while the worker reads.
            job = Job(req_id, tokens[:len(tokens)], usable, tuple(state.keys), state.packed)
            pending = self._pending[req_id] = self._prefetcher().submit(job)
            budget = self.config.lookup_wait_ms / 1e3 - self._waited
            if budget > 0:
                began = time.perf_counter()
                pending.done.wait(budget)
                self._waited += time.perf_counter() - began
            if not pending.done.is_set() and not self._stalled():
                return None               # answered at the next ask
        elif not pending.done.is_set():
            if not self.breaker.allow():
                self._abandon(req_id)
                return 0
            # Asked before and still unanswered: while the worker gets through a burst
            # (~0.25 ms a lookup), ask again, until the lookup's deadline.
            if not self._stalled() and self._prefetcher().clock() < (
                    pending.submitted + self.config.lookup_timeout):
                return None
        if not pending.done.is_set():
            # The worker's call has been in flight past lookup_wait_ms (on any ask): the
            # store may hang. Wait out the lookup's own deadline: this is the one step
            # that pays, as sync lookups would in the step the request arrived; then the
            # breaker is open and no ask waits.
            pending.done.wait(max(0.0, pending.submitted + self.config.lookup_timeout
                                  - self._prefetcher().clock()))
            if not pending.done.is_set():
                self._abandon(req_id)
                self._store_down(TimeoutError(f"no lookup answer within "
                                              f"{self.config.lookup_timeout} s"))
                return 0
        del self._pending[req_id]
        answer = pending.answer
        if answer is None:                # closed meanwhile
            return 0
        self._install(state, answer)
        if answer.error is not None:
            raise answer.error
        if answer.count == DOWN:
            return 0
        return self._counted(state, answer.count, answer.lease_id)

    def _stalled(self) -> bool:
        return self._prefetcher().stalled(max(self.config.lookup_wait_ms / 1e3, _STALLED_S))

    def _install(self, state: _Request, answer: Answer) -> None:
        """Keep the worker's conversion and hashing: they are the request's own."""
        if len(answer.tokens) > len(state.tokens):
            state.tokens = answer.tokens
        if len(answer.keys) > len(state.keys):
            state.keys = list(answer.keys)
            state.packed = answer.packed

    def _lookup_job(self, job: Job) -> Answer:
        """On the worker thread: hash the pages not hashed yet, then one Lookup."""
        tokens = np.asarray(job.tokens, dtype=np.int32)
        keys, packed = list(job.keys), job.packed
        t = self.page_tokens
        if job.pages > len(keys):
            new = page_keys(tokens[len(keys) * t:job.pages * t], t, self.seed,
                            parent=keys[-1] if keys else None)
            keys += new
            packed += b"".join(new)
        if not self.breaker.allow():
            return Answer(tokens, tuple(keys), packed, DOWN)
        try:
            count, lease_id = self._ask(Packed(packed[:job.pages * KEY_BYTES], KEY_BYTES))
        except KVStoreError as exc:
            if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED and exc.code not in _DOWN:
                raise
            self._store_down(exc)
            return Answer(tokens, tuple(keys), packed, DOWN)
        self.breaker.succeeded()
        return Answer(tokens, tuple(keys), packed, count, lease_id)

    def _abandon(self, req_id: str) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self._prefetcher().abandon(pending)

    def _drop_lease(self, state: _Request) -> None:
        if state.lease_id:
            self._leases_to_release.append(state.lease_id)
            state.lease_id = 0

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The engine gave the request blocks (all of them) for local + external tokens."""
        state = self._requests.get(req_id)
        if state is None:
            return
        state.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            self._drop_lease(state)       # the engine loads nothing: nothing to pin
            return
        t = self.page_tokens
        first = state.local_tokens // t
        last = first + num_external_tokens // t
        keys = state.keys[first:last]
        blocks = np.asarray(state.block_ids[first * self.blocks_per_page:
                                            last * self.blocks_per_page], dtype=np.int64)
        is_async = self.config.load_mode.value == "async"
        load_id, self._next_load_id = self._next_load_id, self._next_load_id + 1
        # The lease moves to the load: it is held until the load's outcome is known.
        self._unconfirmed[load_id] = _Load(
            req_id, first, frozenset(blocks.tolist()), state.lease_id,
            None if is_async else self._builds + 1 + self.lag)
        state.lease_id = 0
        self._loads.append(LoadSpec(req_id, tuple(keys),
                                    blocks.reshape(len(keys), self.blocks_per_page),
                                    is_async, load_id))

    def scheduled(self, req_id: str, tokens, num_computed_tokens: int, num_new_tokens: int,
                  block_ids: Sequence[int] | None = None, new_block_ids: Sequence[int] = (),
                  prompt_len: int | None = None) -> None:
        """The engine runs num_new_tokens after num_computed_tokens this step; pages that
        become full are saved (layer by layer, as the engine writes their KV)."""
        state = self._state(req_id, tokens, prompt_len)
        if block_ids is not None:
            state.block_ids = list(block_ids)
        elif new_block_ids:
            state.block_ids.extend(new_block_ids)
        if (not self.config.role.saves or self.config.save is SavePolicy.NONE
                or state.tainted):
            return
        t = self.page_tokens
        full = min(num_computed_tokens + num_new_tokens, len(state.tokens)) // t
        if self.config.save is SavePolicy.PROMPT:
            full = min(full, state.prompt_len // t)
        full = min(full, len(state.block_ids) // self.blocks_per_page)
        start = state.saved_pages
        if full <= start:
            return
        keys = self._keys_upto(state, full)[start:full]
        k = self.blocks_per_page
        blocks = np.asarray(state.block_ids[start * k:full * k], dtype=np.int64)
        self._saves.append(SaveSpec(req_id, tuple(keys), blocks.reshape(len(keys), k),
                                    self._reads(state.block_ids[:full * k])))
        state.saved_pages = full

    def _reads(self, prefix_blocks: Sequence[int]) -> tuple[int, ...]:
        """The unconfirmed loads whose blocks lie in a request's prefix."""
        if not self._unconfirmed:
            return ()
        prefix = set(prefix_blocks)
        return tuple(load_id for load_id, load in self._unconfirmed.items()
                     if not load.blocks.isdisjoint(prefix))

    def build(self) -> StepMeta:
        """This step's plan for the workers; the scheduler half forgets it."""
        self._builds += 1
        self._waited = 0.0            # the next step's lookups get lookup_wait_ms anew
        # Layer-wise loads whose step's outcome has come back without a failure.
        for load_id, load in list(self._unconfirmed.items()):
            if load.confirm_at is not None and load.confirm_at <= self._builds:
                self._settle(load_id, ok=True)
        meta = StepMeta(tuple(self._loads), tuple(self._saves), self.breaker.open,
                        tuple(self._ok), tuple(self._failed))
        self._loads.clear()
        self._saves.clear()
        self._ok.clear()
        self._failed.clear()
        self._release_dropped()
        return meta

    def _settle(self, load_id: int, ok: bool) -> None:
        """The load's outcome is known: its lease can go, and the workers hear of it."""
        load = self._unconfirmed.pop(load_id)
        if load.lease_id:
            self._leases_to_release.append(load.lease_id)
        (self._ok if ok else self._failed).append(load_id)

    def _release_dropped(self) -> None:
        # Prefetch: the worker sends them, off the loop.
        if self._worker is not None:
            self._worker.release(self._leases_to_release)
            self._leases_to_release = []
        else:
            self._leases_to_release = self._send_releases(self._leases_to_release)

    def _send_releases(self, lease_ids: list[int]) -> list[int]:
        """Release leases; returns those kept for later (the store is not answering).

        Releases go only to a store that answers: one that hangs would cost every
        release its timeout. They wait while the breaker is open (its probe closes it);
        one never sent only costs its pages their pin until lease_ms runs out."""
        del lease_ids[:-_RELEASES_KEPT]
        while lease_ids and self.breaker.allow():
            lease_id = lease_ids[-1]
            try:
                self.client.release_lease(lease_id)
                self.breaker.succeeded()
            except KVStoreError as exc:
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED or exc.code in _DOWN:
                    self._store_down(exc)
                    return lease_ids      # kept, for when the store answers again
                log.debug("releasing lease %d failed: %s", lease_id, exc)
            lease_ids.pop()
        return lease_ids

    def load_finished(self, req_id: str) -> None:
        """The workers report the request's async load done: its lease can go."""
        for load_id, load in list(self._unconfirmed.items()):
            if load.req_id == req_id and load.confirm_at is None:
                self._settle(load_id, ok=True)

    def load_failed_blocks(self, block_ids: set[int]) -> list[str]:
        """The workers could not fill these blocks. The requests whose loads they were
        recompute from the failed page, save what they recompute, and are not offered the
        same hit again; every other request that read them saves nothing more. Returns
        the ids of the requests whose loads failed."""
        failed = []
        for load_id, load in list(self._unconfirmed.items()):
            if load.blocks.isdisjoint(block_ids):
                continue
            self._settle(load_id, ok=False)
            state = self._requests.get(load.req_id)
            if state is None:
                continue
            state.load_failed = True
            state.saved_pages = min(state.saved_pages, load.first_page)
            failed.append(load.req_id)
        for req_id, state in self._requests.items():
            if req_id not in failed and not block_ids.isdisjoint(state.block_ids):
                state.tainted = True
        return failed

    def finished(self, req_id: str) -> None:
        """The request is done (or aborted); nothing of it is held for later."""
        state = self._requests.pop(req_id, None)
        if state is not None:
            self._drop_lease(state)
        if self._worker is not None:
            self._abandon(req_id)
        # Its async load may still be running in a worker: confirm it like a layer-wise
        # one, once the steps in flight have come back.
        for load in self._unconfirmed.values():
            if load.req_id == req_id and load.confirm_at is None:
                load.confirm_at = self._builds + 1 + self.lag

    def close(self) -> None:
        for state in self._requests.values():
            self._drop_lease(state)
        for load_id in list(self._unconfirmed):
            self._settle(load_id, ok=False)
        if self._worker is not None:
            for req_id in list(self._pending):
                self._abandon(req_id)
            self._worker.release(self._leases_to_release)
            self._leases_to_release = self._worker.close(self.config.lookup_timeout + 0.5)
        self._leases_to_release = self._send_releases(self._leases_to_release)
        self.breaker.close()
        self.client.close()
