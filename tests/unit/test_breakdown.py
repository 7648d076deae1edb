"""bench.breakdown.CallTimer: host time per call, and only up to a moment when asked."""

import time

from kvstore_bench.breakdown import CallTimer


class Calls:
    def bind_connector_metadata(self, pause):
        time.sleep(pause)
        return "bound"

    def wait_for_save(self):
        return None


def test_sums_each_call_and_stops_at_a_moment():
    obj = Calls()
    with CallTimer(obj) as timer:
        assert obj.bind_connector_metadata(0.02) == "bound"
        middle = time.perf_counter()
        obj.bind_connector_metadata(0.05)
        obj.wait_for_save()
        assert timer.calls == {"bind_connector_metadata": 2, "wait_for_save": 1}
        assert timer.seconds["bind_connector_metadata"] >= 0.07
        before = timer.until(middle)
        assert 0.02 <= before["bind_connector_metadata"] < 0.05
        assert before["wait_for_save"] == 0.0
        timer.reset()
        assert timer.until(time.perf_counter()) == {"bind_connector_metadata": 0.0,
                                                    "wait_for_save": 0.0}
    assert "bind_connector_metadata" not in vars(obj)          # the methods are restored
