"""connector.scheduler.quiet.StepGate: the connector's threads wait for the scheduler's
step to end (its build), and never longer than the bound."""

import threading
import time

from kvstore_connector.scheduler.quiet import StepGate


def _waiter(gate: StepGate, timeout: float) -> tuple[threading.Thread, list]:
    got: list = []

    def run():
        began = time.monotonic()
        got.append((gate.wait(timeout), time.monotonic() - began))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def test_no_step_no_wait():
    gate = StepGate()
    began = time.monotonic()
    assert gate.wait(5.0)
    gate.begin()
    gate.end()
    assert gate.wait(5.0)
    assert time.monotonic() - began < 1.0


def test_a_waiter_goes_when_the_step_ends():
    gate = StepGate()
    gate.begin()
    thread, got = _waiter(gate, 10.0)
    time.sleep(0.1)
    assert not got                          # the step is under way
    gate.end()
    thread.join(5.0)
    assert got and got[0][0] and got[0][1] < 5.0


def test_a_step_that_does_not_end_delays_a_call_by_the_bound_only():
    gate = StepGate()
    gate.begin()
    thread, got = _waiter(gate, 0.05)
    thread.join(5.0)
    assert got and got[0][0] is False and 0.04 <= got[0][1] < 5.0
