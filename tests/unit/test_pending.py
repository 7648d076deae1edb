"""connector.worker.pending: when a step's reservation may be committed, and what of it."""

import numpy as np

from kvstore_connector.meta import LoadSpec, SaveSpec
from kvstore_connector.worker.outcomes import LoadOutcomes
from kvstore_connector.worker.pending import (
    HOLD_STEPS,
    Part,
    PendingSave,
    SaveQueue,
    Settle,
)


def spec(req_id, keys, after=()):
    return SaveSpec(req_id, tuple(keys), np.arange(len(keys)).reshape(-1, 1), tuple(after))


def step_save(*specs, offsets):
    parts, lo = [], 0
    for s in specs:
        parts.append(Part(s, lo, lo + len(s.keys)))
        lo += len(s.keys)
    blocks = np.concatenate([s.block_ids for s in specs])
    return PendingSave(parts, np.zeros(1, np.uint8), np.asarray(offsets, np.int64), blocks,
                       lambda: None, lambda: None, forget=lambda keys: None)


class Handle:
    def __init__(self, done=False, error=None):
        self._done, self.error = done, error

    def done(self):
        if self.error:
            raise RuntimeError(self.error)
        return self._done


def test_nothing_is_decided_before_the_copies_land():
    save = step_save(spec("a", [b"k1"]), offsets=[0])
    assert save.settle(LoadOutcomes(), give_up=True) is Settle.WAIT
    save.landed = True
    assert save.settle(LoadOutcomes(), give_up=False) is Settle.COMMIT


def test_a_part_over_a_failed_load_is_forgotten_and_the_rest_committed():
    outcomes = LoadOutcomes()
    save = step_save(spec("a", [b"a1", b"a2"], after=[7]), spec("b", [b"b1"]),
                     offsets=[0, -1, 4096])
    save.landed = True
    assert save.settle(outcomes, give_up=False) is Settle.WAIT     # load 7 not known yet
    outcomes.failed([7])
    assert save.settle(outcomes, give_up=False) is Settle.PARTIAL
    assert save.dropped_keys() == [b"a1"]        # a2 had no slot here: not deleted
    assert save.stored_pages() == 1


def test_all_parts_dropped_aborts_and_a_single_part_cannot_lose_parts():
    outcomes = LoadOutcomes()
    save = step_save(spec("a", [b"a1"], after=[1]), spec("b", [b"b1"], after=[1]),
                     offsets=[0, 4096])
    save.landed = True
    outcomes.failed([1])
    assert save.settle(outcomes, give_up=False) is Settle.ABORT
    one = PendingSave.of(spec("c", [b"c1"]), np.zeros(1, np.uint8), np.zeros(1, np.int64),
                         lambda: None, lambda: None)
    one.landed = True
    one.drop_over(LoadSpec("c", (b"x",), np.zeros((1, 1), np.int64), False, 3))
    assert one.settle(outcomes, give_up=False) is Settle.ABORT


def test_queue_polls_without_waiting_fails_copies_and_gives_up_waiting_parts():
    queue = SaveQueue()
    waiting = step_save(spec("a", [b"a1"], after=[5]), offsets=[0])
    failed = step_save(spec("b", [b"b1"]), offsets=[4096])
    queue.step.append(waiting)
    queue.enqueued(Handle(done=False))
    queue.step.append(failed)
    queue.enqueued(Handle(error="device error"))
    assert queue.busy() == {"a", "b"} and len(queue) == 2
    errors = []
    ready = queue.poll(LoadOutcomes(), on_error=lambda save, exc: errors.append(save))
    assert ready == [(failed, Settle.ABORT)] and errors == [failed]
    assert queue.busy() == {"a"}              # b's copy is over (failed): its blocks may go
    waiting.handle._done = True
    for _ in range(HOLD_STEPS):
        assert queue.poll(LoadOutcomes(), step=True) == []
    assert queue.poll(LoadOutcomes(), step=True) == [(waiting, Settle.ABORT)]
    assert len(queue) == 0 and queue.busy() == set()
