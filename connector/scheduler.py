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

A store that does not answer costs the step that meets it at most one lookup_timeout;
then the breaker is open (connector.breaker) and no step asks the store anything (no hit,
no wait, lease releases kept) until its background probe finds the store answering. A
request hears "ask again" at most `ask_again` times.

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
from .config import ConnectorConfig, SavePolicy, open_client
from .hashing import KEY_BYTES, page_keys
from .meta import LoadSpec, SaveSpec, StepMeta

__all__ = ["SchedulerHalf"]

log = logging.getLogger(__name__)

_RELEASES_KEPT = 100_000      # lease releases waiting for a store that does not answer
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

    # -- the store ----------------------------------------------------------------------
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
    def _state(self, req_id: str, tokens, prompt_len: int | None = None) -> _Request:
        state = self._requests.get(req_id)
        # Converting a 32k-token list costs milliseconds: only when the request grew.
        if state is None:
            arr = np.asarray(tokens, dtype=np.int32)
            state = _Request(arr, len(arr) if prompt_len is None else prompt_len)
            self._requests[req_id] = state
        elif len(tokens) > len(state.tokens):
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
        state = self._state(req_id, tokens)
        state.local_tokens = num_local_tokens
        # A lease from an earlier answer that was not acted on (the engine could not
        # allocate blocks, or asks again after a preemption) pins pages for nothing:
        # every answer starts by dropping it, whichever way it returns.
        self._drop_lease(state)
        if state.load_failed or state.tainted:
            return 0          # a failed load is recomputed, not retried in a loop
        t = self.page_tokens
        # Never claim the whole prompt: the engine must compute at least its last token.
        usable = (len(state.tokens) - 1) // t
        if usable * t <= num_local_tokens or num_local_tokens % t:
            # Nothing beyond the local hit, or a local hit that ends inside a page (only
            # possible when a page spans several blocks): loading would overwrite blocks
            # the engine already shares, so recompute instead.
            return 0
        self._keys_upto(state, usable)
        # The keys go packed, as one bytes object kept per request: a 32k-token prompt's
        # 2,048 keys are not checked and joined again on every lookup.
        keys = Packed(state.packed[:usable * KEY_BYTES], KEY_BYTES)
        first = num_local_tokens // t
        if not self.breaker.allow():
            return 0          # the store is not answering: no hit, no wait
        try:
            lease = self.client.lookup_lease(self._ns(), keys, self.config.lease_ms) \
                if self.config.lease_ms else None
            count = lease.count if lease else self.client.lookup(self._ns(), keys)
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
        if lease is not None:
            state.lease_id = lease.lease_id
        state.saved_pages = max(state.saved_pages, count)
        if count <= first:
            self._drop_lease(state)
            return 0
        return (count - first) * t

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
        # Releases go only to a store that answers: one that hangs would cost every
        # release its timeout. They wait while the breaker is open (its probe closes it);
        # one never sent only costs its pages their pin until lease_ms runs out.
        del self._leases_to_release[:-_RELEASES_KEPT]
        while self._leases_to_release and self.breaker.allow():
            lease_id = self._leases_to_release[-1]
            try:
                self.client.release_lease(lease_id)
                self.breaker.succeeded()
            except KVStoreError as exc:
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED or exc.code in _DOWN:
                    self._store_down(exc)
                    return                # kept, for when the store answers again
                log.debug("releasing lease %d failed: %s", lease_id, exc)
            self._leases_to_release.pop()

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
        self._release_dropped()
        self.breaker.close()
        self.client.close()
