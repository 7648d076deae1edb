"""The scheduler half: how much of a prompt the store holds, and what to load and save.

It runs beside the engine's scheduler and never touches tensors. Per request:

    hit(req, tokens, local)   -> external tokens to load (page-aligned, beyond the
                                 engine's own prefix cache), None = "ask again", leasing
                                 the counted pages so they cannot vanish before the load
    allocated(req, blocks, n) -> a LoadSpec for the next step's metadata
    scheduled(req, ...)       -> SaveSpecs for pages this step completes
    build()                   -> the StepMeta for the workers (and forget it)
    load_finished / load_failed_blocks / finished(req) -> leases released, state dropped

Its parts, each a module of this package: what is kept per request and its page keys
(requests); the calls to the store behind a breaker (lookups); the loads whose outcome is
not known yet, which hold their lease and the saves that read them (unconfirmed); the
lookup worker thread (prefetch). A failed load marks its request so that the pages it recomputes are saved, and marks every other
request that read the failed blocks as tainted: it saves nothing more, whatever restart
point the engine picks for it (docs/vllm-load-failure-sharing.md).

Where the lookups run (ConnectorConfig.lookups). "sync": on the caller's thread, one
Lookup per request as the engine asks. "prefetch" (the default): a request seen for the
first time is looked up on the caller's thread while the worker thread (prefetch)
is idle and the step's lookup_wait_ms is not spent; else it is handed to the worker, which
hashes it and looks it up, and the caller waits for that answer only while the step's
lookup_wait_ms lasts, else hears "ask again". A later ask takes the answer if it has come,
else hears "ask again" while the worker gets through its queue, up to lookup_timeout after the first ask (then
"no hit"). An ask that finds the worker's call in flight past lookup_wait_ms (at least
2 ms: the store may hang) waits for its answer until that deadline instead, so a hung
store costs one step one timeout and then opens the breaker. Lease releases go through the
same worker. A prefetched answer is dropped, and its lease released, when the request
finishes first, or when its tokens changed before the answer was taken (it counted
pages of other tokens); a lease is released on every path. A request hears "ask again"
at most `ask_again` times after a timeout (sync lookups).

Keys are the connector's chained page hashes (connector.scheduler.hashing), computed once per page
and extended as a request grows.

Over 400 lines because it is the sequence an engine drives over one table of request
states (hit, allocated, scheduled, build, outcomes). The prefetched hit (_hit_prefetched
and its helpers, about 110 lines: an ask's states against the lookup worker and the
step's wait budget) is a second idea and the next split, into a part that owns the
pending answers and that budget.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import numpy as np

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.results import Pins
from kvstore_protocol.keys import Packed

from ..breaker import Breaker
from ..config import (
    ConnectorConfig,
    LoadMode,
    LookupMode,
    SavePolicy,
    min_hit_tokens,
    open_client,
)
from ..groups import NULL_BLOCK, CacheGroup, GroupKind
from ..meta import LoadSpec, PagePins, SaveSpec, StepMeta
from .hashing import KEY_BYTES
from .lookups import StoreLookups
from .mamba import StateCheckpoints, StateLookups, saveable_rows
from .prefetch import DOWN, Answer, Job, LookupWorker, Pending
from .quiet import StepGate
from .requests import RequestState, new_keys
from .unconfirmed import UnconfirmedLoads

__all__ = ["SchedulerHalf"]

# A prefetched lookup in flight for longer than this (or lookup_wait_ms, if longer) may be
# meeting a hung store: a healthy one takes a fraction of it.
_STALLED_S = 0.002


class SchedulerHalf:
    """Engine-agnostic scheduler logic; adapters translate engine objects into calls."""

    def __init__(self, config: ConnectorConfig, layouts: Sequence[PageLayout], block_size: int,
                 client: KVStoreClient | None = None, *, lag: int = 1,
                 groups: Sequence[CacheGroup] = (),
                 checkpoints: StateCheckpoints | None = None,
                 gate: StepGate | None = None) -> None:
        """lag: how many builds later a step's outcome is known (the engine's number of
        batches in flight: vLLM's max_concurrent_batches). layouts: every rank's layout
        of every group; one Lookup over them all answers what every group holds.
        groups: a hybrid engine's KV-cache groups (connector.groups); none = one group,
        full attention. Block ids then come one list per group. checkpoints: where a
        Mamba group's prefill checkpoint states are written (connector.scheduler.mamba); None:
        none is saved. gate: where its steps are marked (quiet.StepGate; None: a gate of
        its own); scheduler halves of one process may share one."""
        if not layouts:
            raise ValueError("the scheduler half needs at least one layout (one per rank)")
        self.groups = tuple(groups)
        # Mamba state (connector.scheduler.mamba): its pages are sparse, so its layouts are not in
        # the full groups' Lookup; a hit's end is checked against them on its own.
        self._mamba = [g.index for g in self.groups if g.kind is GroupKind.MAMBA]
        per_group = len(layouts) // max(1, len(self.groups))
        state_layouts = [layouts[i * per_group + r] for i in self._mamba
                         for r in range(per_group)]
        layouts = [lay for lay in layouts if lay not in state_layouts]
        self.config = config
        self.page_tokens = layouts[0].page_tokens
        if self.page_tokens % block_size:
            raise ValueError(f"page_tokens {self.page_tokens} must be a multiple of the "
                             f"engine's block size {block_size}")
        self.block_size = block_size
        self.blocks_per_page = self.page_tokens // block_size
        self.seed = layouts[0].chain_seed
        # A drafter's KV at a position reads the token after it: with a draft group, a
        # page is saved (in every group, so their counts stay aligned) only once the
        # engine has computed a token past its end (connector.groups).
        self._volatile_tail = any(g.kind is GroupKind.DRAFT for g in self.groups)
        # Hits shorter than this are not worth loading on this tier (ConnectorConfig): a
        # request that cannot reach it is not looked up. Its pages are not saved either
        # until it reaches it: a hit that long needs that many leading pages stored, and
        # the request that makes them stored is that long itself. Not so where a group
        # frees blocks as the request grows (a sliding window: vLLM hands back the blocks
        # behind the window, which then could never be saved; Mamba: a state is saved
        # only in the step that wrote it): there every page is saved as it fills.
        self.min_hit = min_hit_tokens(config)
        self._may_defer = all(g.kind in (GroupKind.FULL, GroupKind.DRAFT) for g in self.groups)
        # The scheduler only asks and leases: no page bytes, so no shared memory (but the
        # server's Unix socket, on its host, unless shared memory is off); and a
        # lookup must answer within lookup_timeout, so no retries either.
        self.store = StoreLookups(config, layouts, client or open_client(
            config, config.lookup_timeout, retries=0, shared_memory=False,
            local_socket=config.shared_memory is not False))
        self._states = StateLookups(self.store, state_layouts) if state_layouts else None
        self._checkpoints = checkpoints
        self._requests: dict[str, RequestState] = {}
        self._loads: list[LoadSpec] = []          # the next build's plan so far
        self._saves: list[SaveSpec] = []
        self._leases_to_release: list[int] = []   # dropped leases, sent at the next build
        self._unconfirmed = UnconfirmedLoads(lag)
        # Prefetched lookups (LookupMode.PREFETCH): the worker, the answers not yet taken
        # (by request id), and the seconds this step has waited for first answers.
        # The worker's releases wait for their answers: off the loop, a wait costs the
        # loop nothing (the GIL is let go), where releases sent back to back without
        # waiting are the worker's Python work, taking the GIL from the loop, and a
        # worker idle sooner has the loop look the next burst up itself (lookup_wait_ms
        # a step): kvstore-bench admit's prefetch loop took about three times as long.
        self._worker = (LookupWorker(self._lookup_job,
                                     functools.partial(self.store.release, wait=True))
                        if config.lookups is LookupMode.PREFETCH else None)
        self._pending: dict[str, Pending] = {}
        self._waited = 0.0
        # A step runs from its first ask to the first build that leaves no prefetched
        # lookup pending: the connector's own threads (retention, KV events) make their
        # calls between steps (quiet.StepGate), not beside its lookups.
        self.gate = gate or StepGate()

    @property
    def client(self) -> KVStoreClient:
        return self.store.client

    @property
    def breaker(self) -> Breaker:
        return self.store.breaker

    @property
    def lag(self) -> int:
        return self._unconfirmed.lag

    @property
    def lookups_pending(self) -> int:
        """Requests whose prefetched lookup is submitted and its answer not yet taken."""
        return len(self._pending)

    @property
    def prefetch(self) -> LookupWorker | None:
        """The worker of prefetched lookups (LookupMode.PREFETCH; None in the other
        modes): its lookups made and whether its call is stalled, read by tests and
        benchmarks."""
        return self._worker

    # -- requests -----------------------------------------------------------------------
    def _state(self, req_id: str, tokens, prompt_len: int | None = None, *,
               convert: bool = True) -> RequestState:
        """The request's state; convert=False leaves a new request's tokens unconverted
        (the lookup worker converts them off the loop)."""
        state = self._requests.get(req_id)
        # Converting a 32k-token list costs milliseconds: only when the request grew.
        if state is None:
            arr = np.asarray(tokens, dtype=np.int32) if convert else np.zeros(0, np.int32)
            state = RequestState(arr, len(tokens) if prompt_len is None else prompt_len,
                                 block_ids=[[] for _ in range(max(1, len(self.groups)))])
            self._requests[req_id] = state
        elif len(tokens) > len(state.tokens) and convert:
            state.tokens = np.asarray(tokens, dtype=np.int32)
        return state

    def _keys_upto(self, state: RequestState, pages: int) -> list[bytes]:
        return state.keys_upto(pages, self.page_tokens, self.seed)

    def hit(self, req_id: str, tokens, num_local_tokens: int) -> int | None:
        """Tokens to load beyond the engine's own `num_local_tokens`; None = ask again."""
        if not self.config.role.loads:
            return 0
        self.gate.begin()
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
        if usable * t - num_local_tokens < self.min_hit:
            self._abandon(req_id)
            return 0          # too short to be worth a lookup on this tier: recompute
        # Asked up to the last full page: one past `usable` when the prompt ends on a page
        # boundary. Held too, that page is not saved again after its compute: a Reserve
        # that would find it stored, a round trip on every such hit. Its lease pins one
        # page more until the load's outcome is known.
        pages = len(tokens) // t
        if prefetch:
            return self._hit_prefetched(req_id, state, tokens, pages, usable)
        self._keys_upto(state, pages)
        # The keys go packed, as one bytes object kept per request: a 32k-token prompt's
        # 2,048 keys are not checked and joined again on every lookup.
        counted = self.store.lookup(Packed(state.packed[:pages * KEY_BYTES], KEY_BYTES))
        if counted.count == DOWN:
            if counted.timed_out and state.asked_again < self.config.ask_again:
                state.asked_again += 1
                return None   # maybe a moment's stall: the engine asks again next step
            return 0          # the store is not answering: no hit, no wait
        return self._counted(state, counted.count, counted.lease_id, usable, counted.pins,
                             counted.use_by)

    def _counted(self, state: RequestState, count: int, lease_id: int, usable: int,
                 pins: Pins | None = None, use_by: float = 0.0) -> int:
        """The store holds `count` leading pages (leased by lease_id, lying where `pins`
        says), of which `usable` may be loaded: the hit to report."""
        state.lease_id = lease_id
        state.pins, state.pins_use_by = (pins, use_by) if lease_id else (None, 0.0)
        previous, state.saved_pages = state.saved_pages, max(state.saved_pages, count)
        first = state.local_tokens // self.page_tokens
        end = min(count, usable)
        if self._states is not None:
            # The state at the hit's end must be stored too: the hit ends at the last
            # boundary below `end` whose state page is there (connector.scheduler.mamba).
            end, state.state_lease = self._states.longest(state.keys, first, end,
                                                          self.config.lease_ms)
            # States past the hit's end are computed again: save them (the full groups'
            # pages there are found stored by the Reserve).
            state.saved_pages = max(previous, end)
        hit = (end - first) * self.page_tokens
        if hit <= 0 or hit < self.min_hit:
            self._drop_lease(state)       # too short to be worth loading: recompute
            return 0
        return hit

    # -- prefetched lookups (LookupMode.PREFETCH) -----------------------------------------
    def _hit_prefetched(  # noqa: C901 - an ask's states in the order a step meets them
            self, req_id: str, state: RequestState, tokens, pages: int,
            usable: int) -> int | None:
        pending = self._pending.get(req_id)
        if pending is not None and (pending.job.pages != pages
                                    or len(pending.job.tokens) != len(tokens)):
            self._abandon(req_id)         # asked for other tokens: its count is not ours
            pending = None
        if pending is None:
            if not self.breaker.allow():
                return 0                  # the store is not answering: no hit, no wait
            if self._prefetcher().idle() and self._waited < self.config.lookup_wait_ms / 1e3:
                return self._hit_inline(state, tokens, pages, usable)
            # A slice, not the list: the engine may append to it while the worker reads.
            job = Job(req_id, tokens[:len(tokens)], pages, tuple(state.keys), state.packed)
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
            # (a lookup at a time), ask again, until the lookup's deadline.
            if not self._stalled() and self._prefetcher().clock() < (
                    pending.submitted + self.config.lookup_timeout):
                return None
        if not pending.done.is_set():
            # The worker's call has been in flight past lookup_wait_ms (on any ask): the
            # store may hang. Wait out the lookup's own deadline: this is the one step
            # that pays, as sync lookups would in the step the request arrived; then the
            # breaker is open and no ask waits (nor a later request of this step).
            if not self.breaker.allow():
                self._abandon(req_id)
                return 0
            pending.done.wait(max(0.0, pending.submitted + self.config.lookup_timeout
                                  - self._prefetcher().clock()))
            if not pending.done.is_set():
                self._abandon(req_id)
                self.store.down(TimeoutError(f"no lookup answer within "
                                             f"{self.config.lookup_timeout} s"))
                return 0
        del self._pending[req_id]
        answer = pending.answer
        if answer is None:                # closed meanwhile
            return 0
        state.take_hashing(answer.tokens, answer.keys, answer.packed)
        if answer.error is not None:
            raise answer.error
        if answer.count == DOWN:
            return 0
        return self._counted(state, answer.count, answer.lease_id, usable, answer.pins,
                             answer.use_by)

    def _hit_inline(self, state: RequestState, tokens, pages: int, usable: int) -> int:
        """A prefetch-mode lookup made on the caller's thread: the worker has nothing to
        do, and this step has not spent its lookup_wait_ms. Handing a lone request to the
        worker and waiting for its answer cost two thread wake-ups, which made a short
        hit's lookup slower than one made on the loop; a burst still goes to the
        worker once the step's lookup_wait_ms is spent. The client's lease lanes take one
        call at a time, so a release the worker sends meanwhile only queues behind it."""
        began = time.perf_counter()
        try:
            if len(tokens) > len(state.tokens):
                state.tokens = np.asarray(tokens, dtype=np.int32)
            self._keys_upto(state, pages)
            counted = self.store.lookup(Packed(state.packed[:pages * KEY_BYTES], KEY_BYTES))
        finally:
            self._waited += time.perf_counter() - began
        if counted.count == DOWN:
            return 0          # not answering (one timeout paid): no hit; the breaker is open
        return self._counted(state, counted.count, counted.lease_id, usable, counted.pins,
                             counted.use_by)

    def _prefetcher(self) -> LookupWorker:
        """The lookup worker (only called in LookupMode.PREFETCH, where it exists)."""
        assert self._worker is not None
        return self._worker

    def _stalled(self) -> bool:
        return self._prefetcher().stalled(max(self.config.lookup_wait_ms / 1e3, _STALLED_S))

    def _lookup_job(self, job: Job) -> Answer:
        """On the worker thread: hash the pages not hashed yet, then one Lookup."""
        tokens = np.asarray(job.tokens, dtype=np.int32)
        new = new_keys(tokens, job.keys, job.pages, self.page_tokens, self.seed)
        keys, packed = job.keys + tuple(new), job.packed + b"".join(new)
        counted = self.store.lookup(Packed(packed[:job.pages * KEY_BYTES], KEY_BYTES))
        return Answer(tokens, keys, packed, counted.count, counted.lease_id,
                      pins=counted.pins, use_by=counted.use_by)

    def _abandon(self, req_id: str) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self._prefetcher().abandon(pending)

    def _drop_lease(self, state: RequestState) -> None:
        if state.lease_id:
            self._leases_to_release.append(state.lease_id)
            state.lease_id = 0
        if state.state_lease:
            self._leases_to_release.append(state.state_lease)
            state.state_lease = 0
        state.pins = None

    # -- blocks, plans and outcomes -------------------------------------------------------
    def _per_group(self, block_ids) -> list[list[int]]:
        """Block ids as one list per group: one engine group may pass a flat list."""
        if len(self.groups) <= 1 and (not len(block_ids)
                                      or not isinstance(block_ids[0], (list, tuple))):
            return [list(block_ids)]
        return [list(blocks) for blocks in block_ids]

    def allocated(self, req_id: str, block_ids, num_external_tokens: int) -> None:
        """The engine gave the request blocks (all of them) for local + external tokens:
        a list, or one list per group."""
        state = self._requests.get(req_id)
        if state is None:
            return
        state.block_ids = self._per_group(block_ids)
        if num_external_tokens <= 0:
            self._drop_lease(state)       # the engine loads nothing: nothing to pin
            return
        t = self.page_tokens
        first = state.local_tokens // t
        last = first + num_external_tokens // t
        keys = state.keys[first:last]
        k = self.blocks_per_page
        rows = [np.asarray(blocks[first * k:last * k], dtype=np.int64).reshape(len(keys), k)
                for blocks in state.block_ids]
        is_async = self.config.load_mode is LoadMode.ASYNC
        # Its pins go with it, for a layer-wise load only: its copies end within its own
        # step, and the lease outlives that step (unconfirmed.py). An async load's may
        # outlast a request that finishes first, so its worker pins the pages itself.
        pins = None
        if state.pins is not None and not is_async:
            pins = PagePins(state.pins.region_id, state.pins_use_by,
                            {lid: offs[first:last] for lid, offs in state.pins.offsets.items()})
        # The lease moves to the load: it is held until the load's outcome is known. Its
        # release says the pages read (served) where the workers will read them from the
        # pins: every page in the pool, in time (worker._pinned checks the same; one that
        # runs out of time between here and the worker is acquired, and counted twice).
        read = len(keys) if pins is not None and time.time() < pins.use_by and all(
            len(o) and o.min() >= 0 for o in pins.offsets.values()) else 0
        load_id = self._unconfirmed.add(
            req_id, first, [int(b) for r in rows for b in r.reshape(-1) if b != NULL_BLOCK],
            state.lease_id, is_async, read,
            extra_leases=(state.state_lease,) if state.state_lease else ())
        state.lease_id, state.state_lease, state.pins = 0, 0, None
        self._loads.append(LoadSpec(req_id, tuple(keys), rows[0], is_async, load_id, pins,
                                    first, tuple(rows) if len(rows) > 1 else ()))

    def scheduled(self, req_id: str, tokens, num_computed_tokens: int, num_new_tokens: int,
                  block_ids: Sequence | None = None, new_block_ids: Sequence = (),
                  prompt_len: int | None = None) -> None:
        """The engine runs num_new_tokens after num_computed_tokens this step; pages that
        become full are saved (layer by layer, as the engine writes their KV). Block ids:
        a list, or one list per group."""
        state = self._state(req_id, tokens, prompt_len)
        if block_ids is not None:
            state.block_ids = self._per_group(block_ids)
        elif len(new_block_ids):
            for have, new in zip(state.block_ids, self._per_group(new_block_ids), strict=True):
                have.extend(new)
        if (not self.config.role.saves or self.config.save is SavePolicy.NONE
                or state.tainted):
            return
        t = self.page_tokens
        done = min(num_computed_tokens + num_new_tokens, len(state.tokens))
        full = (max(0, done - 1) if self._volatile_tail else done) // t
        if self.config.save is SavePolicy.PROMPT:
            full = min(full, state.prompt_len // t)
        k = self.blocks_per_page
        full = min(full, *(len(blocks) // k for blocks in state.block_ids))
        start = state.saved_pages
        if full <= start or (self._may_defer and full * t < self.min_hit):
            return            # the deferred pages go with the step that reaches min_hit
        keys = self._keys_upto(state, full)[start:full]
        rows = [np.asarray(blocks[start * k:full * k], dtype=np.int64).reshape(len(keys), k)
                for blocks in state.block_ids]
        for g in self._mamba:
            # Only the states this step wrote (or brought in) are in their blocks.
            rows[g] = saveable_rows(rows[g], start, num_computed_tokens, done, t,
                                    self._checkpoints)
        self._saves.append(SaveSpec(req_id, tuple(keys), rows[0],
                                    self._unconfirmed.reads(state.all_blocks(full * k)),
                                    tuple(rows) if len(rows) > 1 else ()))
        state.saved_pages = full

    def build(self) -> StepMeta:
        """This step's plan for the workers; the scheduler half forgets it."""
        self._waited = 0.0            # the next step's lookups get lookup_wait_ms anew
        self._unconfirmed.step()
        ok, failed = self._unconfirmed.take_outcomes()
        meta = StepMeta(tuple(self._loads), tuple(self._saves), self.breaker.open, ok, failed)
        self._loads.clear()
        self._saves.clear()
        self._release_dropped()
        if not self._pending:
            self.gate.end()           # else the lookup worker is still busy with the step's
        return meta

    def _release_dropped(self) -> None:
        self.store.note_reads(self._unconfirmed.take_reads())
        self._leases_to_release += self._unconfirmed.take_leases()
        # Prefetch: the worker sends them, off the loop.
        if self._worker is not None:
            self._worker.release(self._leases_to_release)
            self._leases_to_release = []
        else:
            self._leases_to_release = self.store.release(self._leases_to_release)

    def load_finished(self, req_id: str) -> None:
        """The workers report the request's async load done: its lease can go."""
        self._unconfirmed.async_done(req_id)

    def load_failed_blocks(self, block_ids: set[int]) -> list[str]:
        """The workers could not fill these blocks. The requests whose loads they were
        recompute from the failed page, save what they recompute, and are not offered the
        same hit again; every other request that read them saves nothing more. Returns
        the ids of the requests whose loads failed."""
        failed = []
        for load in self._unconfirmed.fail(block_ids):
            state = self._requests.get(load.req_id)
            if state is None:
                continue
            state.load_failed = True
            state.saved_pages = min(state.saved_pages, load.first_page)
            failed.append(load.req_id)
        for req_id, state in self._requests.items():
            if req_id not in failed and not block_ids.isdisjoint(state.all_blocks()):
                state.tainted = True
        return failed

    def load_failed_requests(self, req_ids: set[str]) -> list[str]:
        """As load_failed_blocks, told by request (a hybrid engine's failed_recving):
        every block of their unconfirmed loads, in every group, failed."""
        blocks = self._unconfirmed.blocks_of(req_ids)
        return self.load_failed_blocks(blocks) if blocks else []

    def stored_keys(self, req_id: str) -> list[bytes]:
        """Keys of the request's leading pages known stored: hit, or planned for saving
        (for session retention, connector.scheduler.retention)."""
        state = self._requests.get(req_id)
        return [] if state is None else state.keys[:state.saved_pages]

    def stored_tokens(self, req_id: str) -> np.ndarray:
        """The token ids (int32) of those pages, for the KV events (connector.events):
        a view of the array the request's keys were hashed from, which the GC does not
        walk while the events wait, where the engine's list of ids is walked."""
        state = self._requests.get(req_id)
        if state is None:
            return np.zeros(0, np.int32)
        return state.tokens[:state.saved_pages * self.page_tokens]

    def finished(self, req_id: str) -> None:
        """The request is done (or aborted); nothing of it is held for later."""
        state = self._requests.pop(req_id, None)
        if state is not None:
            self._drop_lease(state)
        if self._worker is not None:
            self._abandon(req_id)
        self._unconfirmed.request_finished(req_id)

    def close(self) -> None:
        self.gate.end()               # no thread waits for a step that will not end
        for state in self._requests.values():
            self._drop_lease(state)
        self._unconfirmed.fail_all()
        self._leases_to_release += self._unconfirmed.take_leases()
        if self._worker is not None:
            for req_id in list(self._pending):
                self._abandon(req_id)
            self._worker.release(self._leases_to_release)
            self._leases_to_release = self._worker.close(self.config.lookup_timeout + 0.5)
        self._leases_to_release = self.store.release(self._leases_to_release)
        self.store.close()
