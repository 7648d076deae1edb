"""A fast-path connection's record of the leases taken on it (ops.Session.leases): the
ones it ends when the connection closes. Capped at MAX_TRACKED, oldest dropped first."""

import socket

import pytest

from kvstore_server.auth import ANONYMOUS
from kvstore_server.fastpath import ops
from kvstore_server.fastpath.io import Reader


@pytest.fixture
def session():
    a, b = socket.socketpair()
    try:
        yield ops.Session(a, Reader(a), True, memoryview(bytearray(16)), ANONYMOUS)
    finally:
        a.close()
        b.close()


def test_a_lease_id_of_zero_is_not_recorded(session):
    session.took(0)
    assert not session.leases


def test_past_the_cap_the_oldest_still_recorded_goes_first(session, monkeypatch):
    monkeypatch.setattr(ops, "MAX_TRACKED", 4)
    for lease_id in range(1, 5):
        session.took(lease_id)
    session.leases.pop(2)                  # ended through the connection (a RELEASE)
    session.took(5)
    assert list(session.leases) == [1, 3, 4, 5]
    session.took(6)                        # one past the cap: 1 goes
    assert list(session.leases) == [3, 4, 5, 6]
    for lease_id in range(7, 107):         # a client that lets its leases expire
        session.took(lease_id)
    assert list(session.leases) == [103, 104, 105, 106]


def test_a_lease_taken_again_keeps_one_entry(session, monkeypatch):
    monkeypatch.setattr(ops, "MAX_TRACKED", 3)
    for lease_id in (1, 2, 1, 3):
        session.took(lease_id)
    assert list(session.leases) == [1, 2, 3]
