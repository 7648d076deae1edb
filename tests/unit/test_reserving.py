"""connector.worker.reserving: the step's Reserve on its own thread, and the layers owed to it."""

import threading

import grpc
import pytest

from kvstore_client import KVStoreError
from kvstore_connector.worker.reserving import StepReserve


def test_layers_owed_before_the_answer_come_back_in_hook_order():
    answered = threading.Event()
    reserve = StepReserve()
    reserve.start(lambda: answered.wait(5) and "reservation", ["spec"])
    assert reserve.pending and not reserve.ready()
    for layer in (0, 1, 2):
        reserve.owe(layer)
    answered.set()
    answer = reserve.take()                   # waits for the thread's answer
    assert not reserve.pending and reserve.take() is None
    assert answer.owed == [0, 1, 2] and answer.specs == ["spec"]
    assert answer.reservation() == "reservation"
    reserve.close()


def test_the_reserves_error_is_raised_where_the_answer_is_taken():
    def fails():
        raise KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED, "not answering")
    reserve = StepReserve()
    reserve.start(fails, [])
    answer = reserve.take()
    with pytest.raises(KVStoreError):
        answer.reservation()
    reserve.close()


def test_a_reserve_not_taken_is_never_overwritten():
    reserve = StepReserve()
    reserve.start(lambda: "first", [])
    with pytest.raises(RuntimeError):
        reserve.start(lambda: "second", [])
    assert reserve.take().reservation() == "first"
    reserve.close()


def test_close_ends_the_thread():
    before = set(threading.enumerate())
    reserve = StepReserve()
    reserve.start(lambda: "r", [])
    reserve.take()
    started = [t for t in set(threading.enumerate()) - before
               if t.name.startswith("kvstore-reserve")]
    assert len(started) == 1
    reserve.close()
    assert not started[0].is_alive()
