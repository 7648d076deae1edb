"""The remote load's deadline rule (connector.worker.deadline): a budget from the bytes still to
come, the measured link and the engine's pace."""

from __future__ import annotations

import pytest

from kvstore_connector.worker.deadline import (
    PACE_CAP_S,
    PRIOR_BYTES_PER_S,
    RATE_MIN_BYTES,
    SLACK,
    Pace,
)


def test_a_fresh_budget_is_the_timeout_and_the_bytes_at_the_prior_rate_times_slack():
    pace = Pace(0.5)
    assert pace.budget(0) == pytest.approx(SLACK * 0.5)
    assert pace.budget(int(PRIOR_BYTES_PER_S)) == pytest.approx(SLACK * 1.5)


def test_a_slow_engine_step_lengthens_the_budget_and_an_idle_gap_counts_at_most_the_cap():
    pace = Pace(0.5)
    t = 100.0
    pace.step(t)
    for _ in range(30):                   # a host taking 2 s a step
        t += 2.0
        pace.step(t)
    assert pace.step_s == pytest.approx(2.0, rel=1e-3)
    assert pace.budget(0) == pytest.approx(SLACK * 2.5, rel=1e-3)
    pace.step(t + 3600)                   # an hour idle is not a slow step
    assert pace.step_s <= PACE_CAP_S


def test_a_measured_link_slower_than_the_prior_lengthens_the_budget_a_faster_one_does_not():
    pace = Pace(0.5)
    pace.finished(RATE_MIN_BYTES - 1, 10.0)       # small: latency, not the link
    assert pace.rate == PRIOR_BYTES_PER_S
    for _ in range(30):
        pace.finished(10 * RATE_MIN_BYTES, 10 * RATE_MIN_BYTES / 10e6)    # 10 MB/s
    assert pace.rate == pytest.approx(10e6, rel=1e-3)
    assert pace.budget(10_000_000) == pytest.approx(SLACK * 1.5, rel=1e-3)
    for _ in range(30):
        pace.finished(10 * RATE_MIN_BYTES, 10 * RATE_MIN_BYTES / 10e9)    # 10 GB/s
    assert pace.rate == PRIOR_BYTES_PER_S


def test_a_load_is_due_later_while_the_workers_other_loads_land_pieces():
    pace = Pace(0.5)
    assert pace.due(10.0, 0) == 10.0                   # nothing landed yet: its own
    pace.landed(50.0)
    assert pace.due(10.0, 0) == pytest.approx(50.0 + SLACK * 0.5)
    pace.landed(40.0)                                  # never earlier
    assert pace.due(10.0, 0) == pytest.approx(50.0 + SLACK * 0.5)
    assert pace.due(99.0, 0) == 99.0
