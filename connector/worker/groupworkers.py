"""One worker half per KV-cache group, seen by the engine as one worker.

Each group of a hybrid model (connector.groups) is its own layout with its own layers, so
each gets a WorkerHalf of its own: its own layout, streams, loads, saves and failure
handling, exactly as for a model of one group. What is the process's rather than a
group's is made once and shared (connector.worker.SharedStore): one client (one set of
connections, one mapping of the store's pool), one CUDA registration of each mapping
(each would pin the whole pool again) and one breaker; this class owns it, prunes its
registrations at step boundaries over every group's copies, and closes it after the
workers. This class hands each the part of
a step's plan that is its group's (connector.groups.for_group), routes a layer's hooks to
the worker that owns the layer, and merges what they report:

    finished()  a request's async load is received once every group that loads pages for
                it has reported it (a failed one is reported too, as vLLM expects)
    sent(ids)   a finished request's blocks may be freed once every group that planned
                saves for it has reported its copies landed
    errors, stats: the union and the sum

Layers the engine never hooks. vLLM 0.33 calls wait_for_layer_load and save_kv_layer
from its attention and MLA layers only (model_executor/layers/attention/
kv_transfer_utils.py): a Mamba / linear-attention layer never calls them. Its loads are
async (landed before the request runs), and its saves are copied at wait_for_save, after
the whole forward has written the step's states: every layer of a group of several that
was not hooked in the step is saved there, before its worker's wait_for_save.

With one group the plan goes to its worker as is: a model of one group behaves exactly as
it did before groups existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ..groups import CacheGroup, for_group
from ..meta import StepMeta
from .half import SharedStore, WorkerHalf, WorkerStats, layer_order

__all__ = ["GroupWorkers"]


class GroupWorkers:
    """Worker halves by group; the calls an engine makes on one worker."""

    def __init__(self, groups: Sequence[CacheGroup], workers: Sequence[WorkerHalf],
                 page_tokens: int, shared: SharedStore | None = None) -> None:
        """shared: what the workers were built over (closed here, after them); None
        where each has its own (a model of one group)."""
        if len(groups) != len(workers) or not groups:
            raise ValueError("one worker half per KV-cache group")
        self.shared = shared
        self.groups = tuple(groups)
        self.workers = tuple(workers)
        self.page_tokens = page_tokens
        self._by_layer = {name: w for g, w in zip(groups, workers, strict=True) for name in g.layer_names}
        self._metas: list[StepMeta] = []          # this step's plan, per group
        # Request id -> the groups not yet reported (async loads received, saves landed).
        self._recving: dict[str, set[int]] = {}
        self._sending: dict[str, set[int]] = {}
        self._hooked: set[str] = set()            # layers whose save hook ran this step

    def _split(self, step: StepMeta) -> list[StepMeta]:
        if len(self.groups) == 1:
            return [step]
        return [for_group(step, g, self.page_tokens) for g in self.groups]

    def bind(self, step: StepMeta) -> None:
        self._metas = self._split(step)
        self._hooked.clear()
        for i, (worker, meta) in enumerate(zip(self.workers, self._metas, strict=True)):
            for load in meta.loads:
                if load.is_async:
                    self._recving.setdefault(load.req_id, set()).add(i)
            for save in meta.saves:
                self._sending.setdefault(save.req_id, set()).add(i)
            worker.bind(meta)

    def start_load(self, step: StepMeta) -> None:
        metas = self._metas or self._split(step)
        for worker, meta in zip(self.workers, metas, strict=True):
            worker.start_load(meta)

    def wait_for_layer(self, name: str) -> None:
        worker = self._by_layer.get(name)
        if worker is not None:            # a layer of no group we move (none today)
            worker.wait_for_layer(name)

    def save_layer(self, name: str) -> None:
        worker = self._by_layer.get(name)
        if worker is not None:
            self._hooked.add(name)
            worker.save_layer(name)

    def wait_for_save(self) -> None:
        for group, worker in zip(self.groups, self.workers, strict=True):
            if len(self.groups) > 1:
                # Layers the engine does not hook (Mamba state): saved now, after the
                # forward, in the worker's layer order.
                for name in layer_order([n for n in group.layer_names
                                         if n not in self._hooked]):
                    worker.save_layer(name)
            worker.wait_for_save()
        self._hooked.clear()

    def finished(self) -> set[str]:
        done = self._merge(self._recving, [w.finished() for w in self.workers])
        if self.shared is not None:
            # A step boundary: a restarted server's old mapping goes once no group's
            # copy uses it.
            self.shared.keep_only([r for w in self.workers for r in w.regions_in_use()])
        return done

    def sent(self, finished_req_ids: Iterable[str] = ()) -> set[str]:
        ids = set(finished_req_ids)
        return self._merge(self._sending, [w.sent(ids) for w in self.workers])

    @staticmethod
    def _merge(waiting: dict[str, set[int]], reports: list[set[str]]) -> set[str]:
        done = set()
        for i, report in enumerate(reports):
            for req_id in report:
                groups = waiting.get(req_id)
                if groups is None:
                    done.add(req_id)
                    continue
                groups.discard(i)
                if not groups:
                    del waiting[req_id]
                    done.add(req_id)
        return done

    def take_stats(self) -> WorkerStats:
        total = WorkerStats()
        for worker in self.workers:
            for field, value in dataclasses.asdict(worker.take_stats()).items():
                setattr(total, field, getattr(total, field) + value)
        return total

    def failed_recving(self) -> set[str]:
        """Requests whose async load failed in any group since the last call."""
        return set().union(*(w.take_failed_recving() for w in self.workers))

    def load_errors(self) -> set[int]:
        return set().union(*(w.load_errors() for w in self.workers))

    def close(self) -> None:
        try:
            for worker in self.workers:
                worker.close()
        finally:
            if self.shared is not None:
                self.shared.close()
