"""connector.scheduler.unconfirmed: a load's lease and outcome are held until the steps in flight
have come back, then handed over once."""

from __future__ import annotations

from kvstore_connector.scheduler.unconfirmed import UnconfirmedLoads


def test_a_layer_wise_load_is_confirmed_lag_builds_after_the_one_that_plans_it():
    loads = UnconfirmedLoads(lag=2)
    load = loads.add("r", 0, [4, 5], lease_id=7, is_async=False)
    loads.step()                                   # the build that plans it
    loads.step()
    assert len(loads) == 1 and loads.take_leases() == []
    loads.step()                                   # lag builds later: it came back
    assert len(loads) == 0
    assert loads.take_outcomes() == ((load,), ())
    assert loads.take_leases() == [7]
    assert loads.take_outcomes() == ((), ()) and loads.take_leases() == []


def test_an_async_load_waits_for_the_workers_or_for_its_request_to_finish():
    loads = UnconfirmedLoads(lag=1)
    a = loads.add("a", 0, [1], lease_id=1, is_async=True)
    b = loads.add("b", 0, [2], lease_id=2, is_async=True)
    for _ in range(5):
        loads.step()
    assert len(loads) == 2                         # builds alone never confirm it
    loads.async_done("a")
    assert loads.take_outcomes() == ((a,), ())
    loads.request_finished("b")                    # may still run: one round trip more
    loads.step()
    assert len(loads) == 1
    loads.step()
    assert loads.take_outcomes() == ((b,), ()) and sorted(loads.take_leases()) == [1, 2]


def test_a_failed_block_fails_the_loads_that_had_it_and_only_those():
    loads = UnconfirmedLoads(lag=1)
    loads.add("a", 2, [10, 11], lease_id=1, is_async=False)
    b = loads.add("b", 0, [20, 21], lease_id=0, is_async=False)
    failed = loads.fail({11, 99})
    assert [(f.req_id, f.first_page) for f in failed] == [("a", 2)]
    assert loads.take_outcomes() == ((), (1,)) and loads.take_leases() == [1]
    assert loads.reads([0, 20]) == (b,)            # a prefix that reads b's blocks
    assert loads.reads([10, 11]) == ()
    loads.fail_all()
    assert len(loads) == 0 and loads.take_outcomes() == ((), (b,))
    assert loads.take_leases() == []               # b held no lease


def test_pages_read_under_pins_are_named_for_good_loads_only():
    """A load read from its lease's pins names its pages once it is good, for the
    release to count them as served; a failed one, or one acquired, names none."""
    loads = UnconfirmedLoads(lag=1)
    loads.add("good", 0, [1, 2], lease_id=1, is_async=False, read=2)
    loads.add("bad", 0, [3], lease_id=2, is_async=False, read=1)
    loads.add("acquired", 0, [4], lease_id=3, is_async=False)
    loads.fail({3})
    loads.step()
    loads.step()
    assert sorted(loads.take_leases()) == [1, 2, 3]
    assert loads.take_reads() == {1: 2}
    assert loads.take_reads() == {}
