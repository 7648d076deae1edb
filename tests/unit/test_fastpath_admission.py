"""The fast path's admission: a hello budget apart from the authenticated places, and a
tenant's share of those (kvstore_server/fastpath/admission.py)."""

from __future__ import annotations

from kvstore_server.fastpath.admission import Admission


def test_unauthenticated_connections_never_take_an_authenticated_place():
    adm = Admission(limit=2, hello_limit=3, per_tenant=False)
    waiting = [adm.arrive() for _ in range(3)]
    assert all(waiting) and adm.arrive() is None           # the hello budget is full
    assert adm.counts() == (3, 0)
    assert adm.authenticate(waiting[0], "default") is None
    assert adm.counts() == (2, 1)
    assert adm.arrive() is not None                        # its hello place is free again
    adm.leave(waiting[0])
    assert adm.counts() == (3, 0)


def test_a_tenant_holds_at_most_half_with_more_than_one_tenant():
    adm = Admission(limit=4, hello_limit=16, per_tenant=True)
    b = [adm.arrive() for _ in range(3)]
    assert adm.authenticate(b[0], "b") is None and adm.authenticate(b[1], "b") is None
    refused = adm.authenticate(b[2], "b")
    assert refused is not None and "'b' has 2" in refused
    assert adm.counts() == (1, 2)                          # the refused one still waits
    adm.leave(b[2])
    a = [adm.arrive() for _ in range(3)]
    assert adm.authenticate(a[0], "a") is None and adm.authenticate(a[1], "a") is None
    full = adm.authenticate(a[2], "a")
    assert full is not None and "--data-connections" in full
    adm.leave(b[0])
    assert adm.authenticate(a[2], "a") is not None         # a's share, not the whole
    c = adm.arrive()
    assert adm.authenticate(c, "c") is None                # the place b left


def test_one_tenant_may_take_every_place_without_an_auth_file():
    adm = Admission(limit=3, hello_limit=8, per_tenant=False)
    tickets = [adm.arrive() for _ in range(4)]
    assert [adm.authenticate(t, "default") for t in tickets[:3]] == [None] * 3
    assert adm.authenticate(tickets[3], "default") is not None
