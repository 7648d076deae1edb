"""kvstore's connector halves under vLLM's method names, for the reference engine.

The engine-side twin of ``connector.vllm``: it turns the reference scheduler's requests
into calls of the engine-agnostic ``SchedulerHalf`` and ``WorkerHalf``, and nothing more,
so the engine exercises the same code vLLM runs. Scheduler side (``Scheduler`` calls)::

    get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta
      -> update_connector_output (finished loads, failed blocks) -> request_finished

worker side (``Engine.step`` calls; the per-layer pair is the model's ``LayerHooks``)::

    bind_connector_metadata -> start_load_kv -> per layer: wait_for_layer_load,
      save_kv_layer -> wait_for_save -> get_finished(finished ids) -> get_block_ids_with_load_errors

The caches are registered as FlashAttention NHD tensors ``[2, blocks, block_size,
kv_heads, head_size]`` (``connector.kvviews.KVKind.FLASH_NHD``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from kvstore_client import PageLayout
from kvstore_connector.config import ConnectorConfig, LoadMode
from kvstore_connector.kvviews import KVKind, kv5
from kvstore_connector.meta import StepMeta
from kvstore_connector.scheduler import SchedulerHalf
from kvstore_connector.worker import WorkerHalf

from .model import ModelConfig
from .scheduler import Request, SchedulerOutput

__all__ = ["StoreConnector", "page_layout"]

log = logging.getLogger(__name__)


def page_layout(config: ModelConfig, dtype: torch.dtype, page_tokens: int, *,
                weights: str, salt: str = "") -> PageLayout:
    """The store layout of a model's KV pages.

    ``weights`` names the weights (for random ones, their seed): pages of two engines are
    interchangeable only when their weights are, and the layout's model id is what keeps
    them apart.
    """
    if not weights:
        raise ValueError("weights must name the model's weights (e.g. 'seed=0')")
    return PageLayout(model=f"{config.name}/{weights}", num_layers=config.num_layers,
                      page_tokens=page_tokens, num_kv_heads=config.num_kv_heads,
                      head_size=config.head_size, dtype=str(dtype).removeprefix("torch."),
                      salt=salt)


class StoreConnector:
    """Both halves of the kvstore connector for one single-process engine."""

    def __init__(self, config: ConnectorConfig, layout: PageLayout,
                 kv_caches: Mapping[str, torch.Tensor], block_size: int) -> None:
        self.config = config
        self.layout = layout
        self.scheduler_half = SchedulerHalf(config, [layout], block_size)
        views = {name: kv5(t, KVKind.FLASH_NHD) for name, t in kv_caches.items()}
        self.worker_half = WorkerHalf(config, layout, views)
        # Requests a save was planned for: the engine holds their blocks after they
        # finish until get_finished reports the save copies landed (saves are async).
        self._saving: set[str] = set()

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        hit = self.scheduler_half.hit(request.req_id, request.all_token_ids,
                                      num_computed_tokens)
        if hit is None:
            return None, False
        return hit, hit > 0 and self.config.load_mode is LoadMode.ASYNC

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        self.scheduler_half.allocated(request.req_id, block_ids, num_external_tokens)

    def build_connector_meta(self, output: SchedulerOutput) -> StepMeta:
        sched = self.scheduler_half
        for s in output.scheduled:
            r = s.request
            # In one process the whole block table is at hand: pass it every time rather
            # than vLLM's new-blocks-only deltas.
            sched.scheduled(r.req_id, r.all_token_ids, s.num_computed_tokens,
                            s.num_new_tokens, block_ids=r.block_ids,
                            prompt_len=r.num_prompt_tokens)
        meta = sched.build()
        self._saving.update(save.req_id for save in meta.saves)
        return meta

    def update_connector_output(self, finished_recving: frozenset[str],
                                invalid_block_ids: frozenset[int]) -> None:
        # Failures first: a failed async load is reported as received too.
        if invalid_block_ids:
            failed = self.scheduler_half.load_failed_blocks(set(invalid_block_ids))
            if failed:
                log.warning("kvstore loads failed for %s: recomputing", failed)
        for req_id in finished_recving:
            self.scheduler_half.load_finished(req_id)

    def request_finished(self, request: Request) -> bool:
        """True: hold the request's blocks until get_finished reports it sent (its save
        copies may still be reading them)."""
        self.scheduler_half.finished(request.req_id)
        delay = request.req_id in self._saving
        self._saving.discard(request.req_id)
        return delay

    # -- worker side ----------------------------------------------------------------------
    def bind_connector_metadata(self, meta: StepMeta) -> None:
        self.worker_half.bind(meta)

    def start_load_kv(self, meta: StepMeta) -> None:
        self.worker_half.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_half.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.worker_half.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker_half.wait_for_save()

    def get_finished(self, finished_req_ids: frozenset[str] = frozenset()
                     ) -> tuple[frozenset[str], frozenset[str]]:
        """(requests whose saves have landed: free their blocks, async loads done)."""
        received = frozenset(self.worker_half.finished())
        return frozenset(self.worker_half.sent(finished_req_ids)), received

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return frozenset(self.worker_half.load_errors())

    def close(self) -> None:
        self.worker_half.close()
        self.scheduler_half.close()
