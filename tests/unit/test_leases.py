import numpy as np

from kvstore_server.store.leases import LeaseKind, LeaseTable, footprint


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_expiry_in_order_and_pop():
    clock = Clock()
    table = LeaseTable(clock)
    a = table.grant(LeaseKind.READ, np.array([1]), ttl=1.0)
    b = table.grant(LeaseKind.RESERVE, np.array([2]), ttl=5.0, layout=0, keys=[b"k"])
    assert a.lease_id != b.lease_id and len(table) == 2
    assert table.expired() == []
    clock.now += 2
    assert [lease.lease_id for lease in table.expired()] == [a.lease_id]
    assert table.pop(a.lease_id) is None
    assert table.pop(b.lease_id) is b
    clock.now += 10
    assert table.expired() == []          # popped leases never expire again


def test_released_leases_leave_nothing_behind():
    clock = Clock()
    table = LeaseTable(clock)
    for _ in range(10_000):                  # streams' leases, and short ones released early
        table.pop(table.grant(LeaseKind.READ, np.array([1]), ttl=float("inf")).lease_id)
        table.pop(table.grant(LeaseKind.READ, np.array([1]), ttl=30.0).lease_id)
    kept = table.grant(LeaseKind.READ, np.array([2]), ttl=1.0)
    assert len(table) == 1 and len(table._expiry) <= 1024 + 3
    clock.now += 2
    assert table.expired() == [kept]


def test_held_counts_the_leases_clients_hold_until_they_end():
    clock = Clock()
    table = LeaseTable(clock)
    stream = table.grant(LeaseKind.READ, np.arange(1000), ttl=float("inf"))
    assert table.held == 0                       # a stream's lease: its handler bounds it
    read = table.grant(LeaseKind.READ, np.arange(1000), ttl=1.0)
    res = table.grant(LeaseKind.RESERVE, np.arange(3), ttl=5.0, layout=0,
                      keys=[b"a", b"b", b"c"])
    assert table.held == footprint(1000) + footprint(3, 3)
    table.pop(res.lease_id)
    assert table.held == footprint(1000)
    clock.now += 2
    assert table.expired() == [read] and table.held == 0
    broken = table.grant(LeaseKind.READ, np.arange(7), ttl=5.0)
    assert table.take_breakable() == [broken] and table.held == 0
    assert table.pop(stream.lease_id) is stream and table.held == 0
