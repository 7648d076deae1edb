"""The reference engine's scheduler: vLLM v1's loop over a waiting and a running queue.

One call of ``schedule()`` plans one step, as vLLM's ``Scheduler.schedule()`` does
(docs/dev/vllm-0.33-connector-api.md, section 4; the ``sched:`` line numbers cite
vllm/v1/core/sched/scheduler.py of 0.33)::

    running, in order        each gets min(its remaining tokens, the token budget); a
                             request that needs a block no one can give preempts the
                             running request scheduled last (FCFS), which frees its
                             blocks and goes back to the head of the waiting queue with
                             num_computed_tokens = 0 (the connector is not told)
    waiting, in order        only if nothing was preempted this step:
      WAITING_FOR_REMOTE_KVS   promoted once the workers reported its load finished
                               (finished_recving), else skipped: it stays in the queue
                               but blocks no one behind it
      fresh or preempted       connector.get_num_new_matched_tokens(request, local)
                               -> (None: ask again next step, skipped) or (hit, async)
                             blocks for computed + new tokens, or stop: the queue waits
                             connector.update_state_after_alloc(request, blocks, hit)
                             async: 0 tokens now, WAITING_FOR_REMOTE_KVS until loaded
                             else RUNNING in this very step (a layer-wise load)
    connector.build_connector_meta(output)      before num_computed_tokens advance

and ``update_from_output()`` takes the step's results back: invalid (failed) load blocks
send their requests back to recompute, sampled tokens are appended, finished requests
are handed to ``connector.request_finished`` and freed (or, when it answers True, held
until the workers report the request in ``finished_sending``: its saves are still copying
from the blocks), and finished loads are noted for promotion in the next ``schedule()``.

Chunked prefill is the token budget: a prompt longer than what is left of
``max_num_batched_tokens`` runs in pieces over several steps. There is no engine-side
prefix cache (the "local" hit is always 0): a shared prefix is shared through the store.
Pure bookkeeping: no torch, no RPC, no clock; the connector is whatever implements
``SchedulerConnector``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "BlockPool",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConnector",
    "SchedulerOutput",
    "StepResult",
]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # an async load is in flight
    RUNNING = "running"
    PREEMPTED = "preempted"                            # waiting again, blocks freed
    FINISHED = "finished"                              # max_tokens reached
    ABORTED = "aborted"


class Request:
    """One request's tokens and progress; the scheduler's live object, as in vLLM."""

    def __init__(self, req_id: str, prompt: Sequence[int] | np.ndarray, max_tokens: int) -> None:
        prompt = np.asarray(prompt, dtype=np.int32).reshape(-1)
        if not len(prompt) or max_tokens < 1:
            raise ValueError(f"request {req_id!r}: needs a prompt and max_tokens >= 1")
        self.req_id = req_id
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        # Prompt and outputs in one buffer that never moves: all_token_ids is a view, so
        # handing it to the connector every step copies nothing.
        self._tokens = np.empty(len(prompt) + max_tokens, dtype=np.int32)
        self._tokens[:len(prompt)] = prompt
        self.num_tokens = len(prompt)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0       # tokens whose K/V are in this request's blocks
        self.block_ids: list[int] = []
        self.num_external_tokens = 0       # the store's hit when last scheduled afresh
        self.num_preemptions = 0
        self.load_failed = False           # its async load failed: recompute at promotion

    @property
    def all_token_ids(self) -> np.ndarray:
        return self._tokens[:self.num_tokens]

    @property
    def output_token_ids(self) -> np.ndarray:
        return self._tokens[self.num_prompt_tokens:self.num_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def append_output(self, token: int) -> None:
        self._tokens[self.num_tokens] = token
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")


class BlockPool:
    """The engine's free KV blocks: a LIFO free list (recently freed blocks are reused
    first, as in vLLM's free-block queue without a prefix cache)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return taken

    def give(self, block_ids: Sequence[int]) -> None:
        self._free.extend(reversed(block_ids))


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int                       # KV blocks in the engine's paged cache
    block_size: int = 16                  # tokens per block
    max_num_batched_tokens: int = 8192    # the token budget of one step (vLLM's serving
                                          # default on 70+ GB GPUs)
    max_num_seqs: int = 256               # running requests at most
    enable_chunked_prefill: bool = True   # False: a prompt runs whole or waits
    long_prefill_token_threshold: int = 0  # cap on one request's tokens per step; 0 = none

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be "
                             "positive")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 = no cap)")


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_computed_tokens: int        # before this step: local + external hit, or progress
    num_new_tokens: int             # tokens computed this step
    new_block_ids: tuple[int, ...]  # blocks added this step (all of them when first_time)
    first_time: bool                # new or resumed: the whole block table is new
    num_external_tokens: int        # loaded by the connector in this step (layer-wise)

    @property
    def samples(self) -> bool:
        """Whether the step reaches the request's last token, so a token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted_req_ids: tuple[str, ...]
    finished_req_ids: tuple[str, ...]     # finished since the previous step
    has_sync_kv_loads: bool               # start the loads before the forward
    connector_meta: Any = None            # the connector's plan for the workers

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What the model runner and the connector's workers report after a step."""

    sampled: dict[str, int]                          # req_id -> next token
    finished_recving: frozenset[str] = frozenset()   # async loads now complete
    invalid_block_ids: frozenset[int] = frozenset()  # blocks whose load failed
    finished_sending: frozenset[str] = frozenset()   # finished requests' saves landed


class SchedulerConnector(Protocol):
    """The scheduler-side calls of a KV connector, under vLLM's names."""

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, output: SchedulerOutput) -> Any: ...

    def update_connector_output(self, finished_recving: frozenset[str],
                                invalid_block_ids: frozenset[int]) -> None: ...

    def request_finished(self, request: Request) -> bool | None:
        """True: keep the request's blocks until it is reported in finished_sending."""


class Scheduler:
    """Plans steps and tracks requests; see the module docstring for the loop."""

    def __init__(self, config: SchedulerConfig,
                 connector: SchedulerConnector | None = None) -> None:
        self.config = config
        self.connector = connector
        self.blocks = BlockPool(config.num_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._finished_recving: set[str] = set()  # loaded, promoted at the next schedule()
        self._finished_ids: list[str] = []        # for the next SchedulerOutput
        self._held: dict[str, Request] = {}       # aborted mid-load: blocks freed once loaded
        self._sending: dict[str, Request] = {}    # finished, saves copying: freed once sent

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if (request.req_id in self.requests or request.req_id in self._held
                or request.req_id in self._sending):
            raise ValueError(f"request id {request.req_id!r} is already in use")
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def abort(self, req_id: str) -> None:
        request = self.requests.get(req_id)
        if request is not None:
            self._finish(request, RequestStatus.ABORTED)

    def has_unfinished(self) -> bool:
        """Requests not finished, or finished with saves still copying from their blocks
        (the engine steps on until those are reported, so it ends with them stored)."""
        return bool(self.requests or self._sending)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._cap(request.num_tokens - request.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            new_blocks = self._grow(request, request.num_computed_tokens + n)
            while new_blocks is None:             # preempt from the back until it fits
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = self._grow(request, request.num_computed_tokens + n)
            if new_blocks is None:
                break
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, n,
                                              tuple(new_blocks), False, 0))
            budget -= n
            i += 1

        skipped: list[Request] = []
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            request = self.waiting[0]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS \
                    and not self._promote(request):
                skipped.append(self.waiting.popleft())      # does not block the others
                continue
            external, load_async = 0, False
            if request.num_computed_tokens == 0:
                if self.connector is not None:
                    external, load_async = self.connector.get_num_new_matched_tokens(request, 0)
                    if external is None:                    # the store did not answer in
                        skipped.append(self.waiting.popleft())   # time: ask again later
                        continue
                request.num_external_tokens = external
                computed = external
            else:
                computed = request.num_computed_tokens     # promoted after an async load
            if load_async:
                n = 0
            else:
                n = request.num_tokens - computed
                if not cfg.enable_chunked_prefill and n > budget:
                    break
                n = self._cap(n, budget)
            first_time = not request.block_ids
            new_blocks = self._grow(request, computed + n)
            if new_blocks is None:
                break                                       # vLLM: the queue waits
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, request.block_ids, external)
            self.waiting.popleft()
            request.num_computed_tokens = computed          # the hit counts as computed
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, computed, n, tuple(new_blocks),
                                              first_time, external))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        output = SchedulerOutput(
            scheduled=tuple(scheduled),
            preempted_req_ids=tuple(r.req_id for r in preempted),
            finished_req_ids=tuple(self._finished_ids),
            has_sync_kv_loads=any(s.num_external_tokens for s in scheduled))
        self._finished_ids = []
        if self.connector is not None:
            output = dataclasses.replace(
                output, connector_meta=self.connector.build_connector_meta(output))
        for s in scheduled:                    # vLLM's _update_after_schedule
            s.request.num_computed_tokens += s.num_new_tokens
        return output

    def update_from_output(self, output: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply a step's results; returns the requests that finished in it."""
        failed = self._handle_invalid_blocks(output, result.invalid_block_ids)
        finished = []
        for s in output.scheduled:
            request = s.request
            if request.req_id in failed or request.is_finished or not s.samples:
                continue
            request.append_output(result.sampled[request.req_id])
            if request.num_tokens - request.num_prompt_tokens >= request.max_tokens:
                self._finish(request, RequestStatus.FINISHED)
                finished.append(request)
        if self.connector is not None:
            self.connector.update_connector_output(result.finished_recving,
                                                   result.invalid_block_ids)
        for req_id in result.finished_recving:
            held = self._held.pop(req_id, None)
            if held is not None:                 # aborted while loading: free it now
                if req_id not in self._sending:
                    self._free(held)
            elif req_id in self.requests:
                self._finished_recving.add(req_id)
        for req_id in result.finished_sending:
            sent = self._sending.pop(req_id, None)
            if sent is not None and req_id not in self._held:
                self._free(sent)
        return finished

    def _free(self, request: Request) -> None:
        self.blocks.give(request.block_ids)
        request.block_ids = []

    # -- internals ------------------------------------------------------------------------
    def _cap(self, n: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold and n > threshold:
            n = threshold
        return min(n, budget)

    def _grow(self, request: Request, num_tokens: int) -> list[int] | None:
        """Blocks so that request holds num_tokens; the new ones, or None if none free."""
        need = -(-num_tokens // self.config.block_size) - len(request.block_ids)
        if need <= 0:
            return []
        got = self.blocks.take(need)
        if got is not None:
            request.block_ids.extend(got)
        return got

    def _preempt(self, request: Request) -> None:
        self.blocks.give(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _promote(self, request: Request) -> bool:
        """A WAITING_FOR_REMOTE_KVS request whose load finished becomes schedulable."""
        if request.req_id not in self._finished_recving:
            return False
        self._finished_recving.discard(request.req_id)
        if request.load_failed:        # recompute: free all, go through the lookup again
            self.blocks.give(request.block_ids)
            request.block_ids = []
            request.num_computed_tokens = 0
            request.load_failed = False
        elif request.num_computed_tokens >= request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1   # compute the last one
        request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                          else RequestStatus.WAITING)
        return True

    def _handle_invalid_blocks(self, output: SchedulerOutput,
                               invalid: frozenset[int]) -> set[str]:
        """vLLM's "recompute" policy: a request whose loaded blocks failed drops this
        step's output and recomputes from its local hit (here 0); an async one does at
        promotion. Returns the ids of requests whose step output is void."""
        if not invalid:
            return set()
        failed = set()
        for s in output.scheduled:
            request = s.request
            if s.num_external_tokens and invalid.intersection(request.block_ids):
                request.num_computed_tokens = 0
                failed.add(request.req_id)
        for request in self.waiting:
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS \
                    and invalid.intersection(request.block_ids):
                request.load_failed = True
        return failed

    def _finish(self, request: Request, status: RequestStatus) -> None:
        loading = (request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
                   and request.req_id not in self._finished_recving)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._finished_recving.discard(request.req_id)
        del self.requests[request.req_id]
        request.status = status
        sending = (self.connector is not None
                   and bool(self.connector.request_finished(request)))
        self._finished_ids.append(request.req_id)
        if loading:                 # the workers still write its blocks: hold them
            self._held[request.req_id] = request
        if sending:                 # the workers still read its blocks: hold them
            self._sending[request.req_id] = request
        if not loading and not sending:
            self._free(request)
