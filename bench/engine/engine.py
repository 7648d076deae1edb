"""The reference engine: one model over a paged KV cache, stepped the way vLLM steps it.

    caches = allocate_kv_caches(model.cache_spec(num_blocks, 16), dtype=model.dtype,
                                device=model.device)
    store = StoreConnector(ConnectorConfig(server=addr),
                           page_layout(model.config, model.dtype, 16, weights="seed=0"),
                           caches, block_size=16)                  # or None: no store
    engine = Engine(model, caches, SchedulerConfig(num_blocks, 16), connector=store)
    engine.add_request("a", prompt_ids, max_tokens=8, keep_logits=True)
    out = engine.run()["a"]           # out.token_ids, out.logits, out.ttft

One ``step()``, in the order vLLM 0.33's model runner makes the connector's worker calls
(docs/dev/vllm-0.33-connector-api.md, section 5)::

    scheduler.schedule()                    lookups, allocation, build_connector_meta
    bind_connector_metadata(meta)           reserve the store slots for this step's saves
    start_load_kv(meta)                     here if the step has layer-wise loads ...
    model forward: per layer write K/V, wait_for_layer_load, attend, save_kv_layer
    start_load_kv(meta)                     ... else here, after the forward is launched
    wait_for_save -> get_finished(finished ids) -> get_block_ids_with_load_errors
    greedy sampling (the step's one host sync) -> scheduler.update_from_output(...)

A step with no scheduled tokens (only loads in flight) skips the forward but still makes
the other calls, as vLLM's no-forward step does. Sampling is greedy (argmax), so two runs
agree token for token exactly when their logits agree.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from .kvconnector import StoreConnector
from .model import NO_HOOKS, LlamaModel, SeqStep
from .paged_cache import check_kv_caches
from .scheduler import Request, Scheduler, SchedulerConfig, StepResult

__all__ = ["Engine", "RequestOutput"]


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request. Times are ``clock()`` readings (perf_counter seconds)."""

    req_id: str
    prompt_len: int
    token_ids: tuple[int, ...]        # generated tokens
    logits: torch.Tensor | None       # [generated, vocab] fp32 on the CPU, if kept
    num_external_tokens: int          # tokens loaded from the store (last scheduling)
    num_preemptions: int
    submitted: float
    first_token: float                # when the first token's logits were on the host
    finished: float

    @property
    def ttft(self) -> float:
        """Seconds from submission to the first token (synchronized)."""
        return self.first_token - self.submitted


# An idle vLLM engine sleeps this long between steps that ran nothing.
IDLE_SECONDS = 0.001


@dataclasses.dataclass(slots=True)
class _Track:
    """What the engine records about a request beside the scheduler's state."""

    keep_logits: bool
    submitted: float
    first_token: float = 0.0
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)


class Engine:
    """vLLM's step loop over ``LlamaModel`` with an optional kvstore connector.

    ``kv_caches`` must match ``config`` (num_blocks, block_size); a connector must have
    been built over the same tensors. Not thread-safe. ``clock`` is a seam for tests.
    """

    def __init__(self, model: LlamaModel, kv_caches: Mapping[str, torch.Tensor],
                 config: SchedulerConfig, *, connector: StoreConnector | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        cfg = model.config
        num_blocks, block_size = check_kv_caches(kv_caches, cfg.num_layers, cfg.num_kv_heads,
                                                 cfg.head_size)
        if (num_blocks, block_size) != (config.num_blocks, config.block_size):
            raise ValueError(f"kv_caches hold {num_blocks} blocks of {block_size} tokens; the "
                             f"scheduler config says {config.num_blocks} of {config.block_size}")
        self.model = model
        self.kv_caches = kv_caches
        self.connector = connector
        self.scheduler = Scheduler(config, connector)
        self.clock = clock
        self._tracks: dict[str, _Track] = {}
        self.num_steps = 0
        self.num_computed_tokens = 0      # tokens run through the model, over all steps

    def add_request(self, req_id: str, prompt: Sequence[int] | np.ndarray, max_tokens: int = 1,
                    *, keep_logits: bool = False) -> None:
        """Queue a request; its TTFT counts from here."""
        self.scheduler.add_request(Request(req_id, prompt, max_tokens))
        self._tracks[req_id] = _Track(keep_logits, self.clock())

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)
        self._tracks.pop(req_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def run(self, max_steps: int = 1_000_000) -> dict[str, RequestOutput]:
        """Step until every request has finished; their outputs by id.

        A step that ran no token is followed by a pause of IDLE_SECONDS, as vLLM's engine
        loop idles: requests can wait on something outside the loop (a prefetched lookup's
        answer), and without it an idle loop spins through its steps in microseconds while
        the answer is on its way."""
        outputs: dict[str, RequestOutput] = {}
        for _ in range(max_steps):
            if not self.has_unfinished():
                return outputs
            before = self.num_computed_tokens
            outputs.update((o.req_id, o) for o in self.step())
            if self.num_computed_tokens == before and self.has_unfinished():
                time.sleep(IDLE_SECONDS)
        raise RuntimeError(f"requests still unfinished after {max_steps} steps: "
                           f"{list(self.scheduler.requests.values())}")

    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward; returns the requests that finished."""
        self.num_steps += 1
        out = self.scheduler.schedule()
        self.num_computed_tokens += out.num_scheduled_tokens
        conn, meta = self.connector, out.connector_meta
        if conn is not None:
            conn.bind_connector_metadata(meta)
            if out.has_sync_kv_loads:
                conn.start_load_kv(meta)
        next_tokens = logits = None
        if out.scheduled:
            seqs = [SeqStep(s.request.all_token_ids[s.num_computed_tokens:
                                                    s.num_computed_tokens + s.num_new_tokens],
                            s.num_computed_tokens, s.request.block_ids)
                    for s in out.scheduled]
            logits = self.model(seqs, self.kv_caches, conn if conn is not None else NO_HOOKS
                                ).logits
            next_tokens = logits.argmax(dim=-1)
        sent, received, invalid = frozenset(), frozenset(), frozenset()
        if conn is not None:
            if not out.has_sync_kv_loads:
                conn.start_load_kv(meta)
            conn.wait_for_save()
            sent, received = conn.get_finished(frozenset(out.finished_req_ids))
            invalid = conn.get_block_ids_with_load_errors()
        sampled: dict[str, int] = {}
        before: dict[str, int] = {}
        if next_tokens is not None:
            tokens = next_tokens.tolist()           # waits for the forward
            now = self.clock()
            for i, s in enumerate(out.scheduled):
                if s.samples:
                    sampled[s.request.req_id] = tokens[i]
                    before[s.request.req_id] = s.request.num_tokens
        finished = self.scheduler.update_from_output(out, StepResult(sampled, received,
                                                                     invalid, sent))
        for i, s in enumerate(out.scheduled):
            r = s.request
            track = self._tracks.get(r.req_id)
            if track is None or r.num_tokens == before.get(r.req_id, r.num_tokens):
                continue                            # no token (a chunk, or a failed load)
            if not track.first_token:
                track.first_token = now
            if track.keep_logits:
                track.logits.append(logits[i].float().cpu())
        return [self._output(r) for r in finished]

    def _output(self, request: Request) -> RequestOutput:
        track = self._tracks.pop(request.req_id)
        return RequestOutput(
            req_id=request.req_id, prompt_len=request.num_prompt_tokens,
            token_ids=tuple(request.output_token_ids.tolist()),
            logits=torch.stack(track.logits) if track.keep_logits else None,
            num_external_tokens=request.num_external_tokens,
            num_preemptions=request.num_preemptions, submitted=track.submitted,
            first_token=track.first_token, finished=self.clock())
