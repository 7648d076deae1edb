"""A step's Reserve runs on its own thread while the engine's thread is busy in Python (a
short forward's launches and hooks): the save hooks' nudges let that thread send and read
its call long before CPython's switch interval would hand it the GIL."""

from __future__ import annotations

import sys
import time

from kvstore_connector.worker.reserving import StepReserve


def test_nudges_let_the_reserve_thread_run_while_the_caller_spins():
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2.0)          # no forced hand-over within the test's spin
    reserve = StepReserve()
    ran = []
    try:
        reserve.start(lambda: "first", [])        # the thread is up (started in the call)
        assert reserve.take().reservation() == "first"
        reserve.start(lambda: ran.append(time.monotonic()) or "answer", [])
        began = time.monotonic()
        # The engine's thread in Python for 0.3 s, a save hook every ~0.2 ms.
        while time.monotonic() - began < 0.3 and not reserve.ready():
            spin = time.monotonic()
            while time.monotonic() - spin < 0.0002:
                pass
            reserve.nudge()
        assert reserve.ready(), "the Reserve's thread never ran while the caller spun"
        assert ran and ran[0] - began < 0.3
        assert reserve.take().reservation() == "answer"
    finally:
        sys.setswitchinterval(interval)
        reserve.close()
