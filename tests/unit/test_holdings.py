"""Holdings: a fast-path connection that holds leases is never closed under them."""

from kvstore_client.holdings import Holdings


class FakeConn:
    def __init__(self):
        self.closed = False
        self.sent_held = 0      # calls of send_held (a held release goes before retiring)

    def send_held(self):
        self.sent_held += 1

    def close(self):
        self.closed = True


def test_a_retired_connection_closes_with_its_last_lease():
    h, conn = Holdings(), FakeConn()
    h.took(conn, 1)
    h.took(conn, 2)
    h.let_go(conn)                      # out of step: kept for its leases
    assert not conn.closed and h.holds(conn)
    assert conn.sent_held == 1          # what it held went out before it was kept
    h.ended(1)
    assert not conn.closed
    h.ended(2)
    assert conn.closed and not h.holds(conn)
    h.ended(2)                          # twice: nothing happens


def test_a_connection_holding_nothing_closes_at_once_and_a_lost_one_forgets():
    h, idle, broken = Holdings(), FakeConn(), FakeConn()
    h.took(idle, 0)                     # no lease (id 0): nothing held
    h.let_go(idle)
    assert idle.closed
    h.took(broken, 5)
    h.lost(broken)                      # the server ended its leases
    assert broken.closed and not h.holds(broken)
    h.ended(5)


def test_a_lane_in_use_is_not_closed_when_its_leases_end_and_close_ends_the_rest():
    h, lane, retired = Holdings(), FakeConn(), FakeConn()
    h.took(lane, 1)
    h.ended(1)
    assert not lane.closed              # still the lane's: in use
    h.took(retired, 2)
    h.let_go(retired)
    h.close()                           # the client closes
    assert retired.closed and not lane.closed


def test_past_max_retired_the_oldest_is_closed():
    from kvstore_client.holdings import MAX_RETIRED

    h = Holdings()
    conns = [FakeConn() for _ in range(MAX_RETIRED + 1)]
    for i, conn in enumerate(conns):
        h.took(conn, i + 1)
        h.let_go(conn)
    assert conns[0].closed and not h.holds(conns[0])
    assert not any(conn.closed for conn in conns[1:])
    h.ended(1)                          # the closed one's lease: already forgotten
    h.ended(2)
    assert conns[1].closed
