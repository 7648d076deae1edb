"""Session retention in-process (kvstore_server.store.retention, store/sessions.py): what a
session keeps from eviction, its quota, and how it ends. tests/integration/
test_retention.py runs the same against a real server."""

import numpy as np
import pytest

from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import PageLayout
from kvstore_server.errors import StoreError
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.store.retention import RetentionLimits

MiB = 1 << 20
# 256 KiB pages: 4 layers of 64 KiB; the 16 MiB region holds about 60 of them
LAYOUT = PageLayout(model="t", num_layers=4, page_tokens=16, num_kv_heads=8, head_size=128)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make(quota=0.5, sessions=4):
    region = Region(16 * MiB)
    clock = Clock()
    s = Store(region, lease_ttl=5.0, clock=clock, retention=RetentionLimits(quota, sessions))
    s.test_clock = clock
    return s, region


@pytest.fixture
def store():
    s, region = make()
    yield s
    region.close()


def keys(prefix, n):
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def put(store, info, ks):
    res = store.reserve(info.layout_id, ks)
    return store.commit(res.lease_id)


def retain(store, info, ks, session="s", ttl=10.0):
    return store.retain(info.layout_id, Packed.of(ks), session, ttl)


def fill_pool(store, info, prefix):
    """Put pages until the pool has had to evict to take them all."""
    capacity = store.pool.capacity_bytes // info.page_bytes
    for i in range(3):
        put(store, info, keys(f"{prefix}{i}", capacity // 2))


def test_retained_prefix_survives_eviction_until_its_ttl(store):
    info = store.register_layout(LAYOUT)
    mine = keys("mine", 8)
    put(store, info, mine)
    assert retain(store, info, mine, ttl=10.0).pages == 8
    fill_pool(store, info, "other")
    assert store.exists(info.layout_id, mine).all()
    store.test_clock.now += 11
    store.expire_leases()
    assert store.stats().retained_pages == 0
    fill_pool(store, info, "later")
    assert not store.exists(info.layout_id, mine).any()


def test_release_ends_it_and_unpins(store):
    info = store.register_layout(LAYOUT)
    mine = keys("mine", 4)
    put(store, info, mine)
    retain(store, info, mine)
    s = store.stats()
    assert (s.retained_pages, s.retention_sessions, s.pinned_pages, s.leased_pages) == (4, 1, 4, 0)
    assert store.release_retention("s", "default") == 4
    assert store.release_retention("s", "default") == 0
    s = store.stats()
    assert (s.retained_pages, s.retention_sessions, s.pinned_pages) == (0, 0, 0)


def test_only_the_leading_run_in_dram_is_retained(store):
    info = store.register_layout(LAYOUT)
    ks = keys("p", 6)
    put(store, info, ks[:3] + ks[4:])
    assert retain(store, info, ks).pages == 3
    assert store.stats().retained_pages == 3


def test_quota_refuses_counts_and_changes_nothing():
    s, region = make(quota=4 * (256 << 10))      # four pages' bytes
    try:
        info = s.register_layout(LAYOUT)
        ks = keys("q", 6)
        put(s, info, ks)
        assert retain(s, info, ks[:3]).refused == ""
        got = retain(s, info, ks)
        assert got.pages == 6 and "quota" in got.refused
        st = s.stats()
        assert (st.retained_pages, st.retention_refused) == (3, 1)
        # Within the quota again: the pages already kept count once.
        assert retain(s, info, ks[:4]).refused == ""
        assert s.stats().retained_pages == 4
    finally:
        region.close()


def test_two_sessions_on_one_prefix_charge_it_once():
    s, region = make(quota=4 * (256 << 10))
    try:
        info = s.register_layout(LAYOUT)
        ks = keys("shared", 4)
        put(s, info, ks)
        assert retain(s, info, ks, "a").refused == ""
        assert retain(s, info, ks, "b").refused == ""
        assert s.stats().pinned_pages == 4
        s.release_retention("a", "default")
        assert s.stats().retained_pages == 4      # b still keeps them
        s.release_retention("b", "default")
        assert s.stats().pinned_pages == 0
    finally:
        region.close()


def test_session_cap_and_off():
    s, region = make(sessions=2)
    try:
        info = s.register_layout(LAYOUT)
        ks = keys("c", 2)
        put(s, info, ks)
        assert retain(s, info, ks, "a").refused == ""
        assert retain(s, info, ks, "b").refused == ""
        assert "sessions" in retain(s, info, ks, "c").refused
        assert retain(s, info, ks, "a").refused == ""      # an existing one grows
    finally:
        region.close()
    s, region = make(quota=0)
    try:
        info = s.register_layout(LAYOUT)
        put(s, info, keys("d", 2))
        assert "off" in retain(s, info, keys("d", 2)).refused
        assert s.stats().retention_refused == 1
    finally:
        region.close()


def test_delete_of_a_retained_page_frees_it_and_ends_its_retention(store):
    info = store.register_layout(LAYOUT)
    ks = keys("del", 4)
    put(store, info, ks)
    retain(store, info, ks)
    used = store.pool.used_bytes
    assert store.delete(info.layout_id, ks[:2]) == 2
    assert store.pool.used_bytes < used                  # freed now, not at the TTL
    assert store.stats().retained_pages == 2
    # The freed slots go to other pages; the session's end must not unpin those.
    other = keys("new", 2)
    put(store, info, other)
    lease = store.acquire(info.layout_id, other)
    assert store.release_retention("s", "default") == 2
    assert store.stats().pinned_pages == 2               # the lease's, still there
    store.release(lease.lease_id)
    assert store.stats().pinned_pages == 0


def test_admin_force_ends_every_session(store):
    info = store.register_layout(LAYOUT)
    put(store, info, keys("f", 3))
    retain(store, info, keys("f", 3))
    store.break_leases()
    s = store.stats()
    assert (s.retained_pages, s.retention_sessions, s.pinned_pages) == (0, 0, 0)


def test_bad_session_or_ttl_is_refused_clearly(store):
    info = store.register_layout(LAYOUT)
    with pytest.raises(StoreError, match="session"):
        retain(store, info, keys("x", 1), session="")
    with pytest.raises(StoreError, match="ttl"):
        retain(store, info, keys("x", 1), ttl=0)
    with pytest.raises(StoreError, match="ttl"):
        retain(store, info, keys("x", 1), ttl=float("inf"))
    assert store.stats().pinned_pages == 0


def test_the_quota_setting_is_a_share_or_a_size():
    from kvstore_server.config import ConfigError, load_config
    assert load_config([], environ={}).retention_quota == 0.1
    assert load_config(["--retention-quota", "0.25"], environ={}).retention_quota == 0.25
    assert load_config(["--retention-quota", "2GiB"], environ={}).retention_quota == 2 << 30
    assert load_config(["--retention-quota", "0"], environ={}).retention_quota == 0
    assert RetentionLimits(0.25).quota_bytes(1 << 30) == 1 << 28
    assert RetentionLimits(float(2 << 30)).quota_bytes(1 << 30) == 2 << 30
    for bad in ("-0.5", "lots"):
        with pytest.raises(ConfigError, match="retention_quota"):
            load_config(["--retention-quota", bad], environ={})
    with pytest.raises(ConfigError, match="retention_sessions"):
        load_config(["--retention-sessions", "0"], environ={})


def test_a_session_retained_every_turn_keeps_the_table_small():
    from kvstore_server.store.retention import RetentionTable
    table = RetentionTable()
    sizes = lambda slots: np.full(len(slots), 1, dtype=np.int64)   # noqa: E731
    for turn in range(1000):
        table.retain("t", "s", np.array([1, 2, turn + 3]), sizes, float(turn), 60.0,
                     RetentionLimits(1e9), 1 << 30)
    assert len(table._heap) <= 2 * len(table) + 64
    assert table.pages() == 1002
    assert [len(s) for s in table.expired(2000.0)] == [1002] and table.pages() == 0


def test_the_pages_sessions_name_are_bounded(monkeypatch):
    from kvstore_server.store import retention
    monkeypatch.setattr(retention, "MAX_ENTRIES", 6)
    s, region = make()
    try:
        info = s.register_layout(LAYOUT)
        ks = keys("e", 4)
        put(s, info, ks)
        assert retain(s, info, ks, "a").refused == ""
        # The same pages again: charged once to the quota, but listed once more.
        assert "most pages" in retain(s, info, ks, "b").refused
        assert retain(s, info, ks[:2], "b").refused == ""
    finally:
        region.close()


def test_a_tenant_with_a_storage_quota_retains_at_most_half_of_it(store):
    info = store.register_layout(LAYOUT)
    ks = keys("half", 4)
    put(store, info, ks)
    page = 256 << 10
    assert "quota" in store.retain(info.layout_id, Packed.of(ks), "s", 10.0,
                                   quota=4 * page).refused
    assert store.retain(info.layout_id, Packed.of(ks[:2]), "s", 10.0,
                        quota=4 * page).refused == ""


def test_the_same_pages_again_move_the_expiry_and_pin_once(store):
    """An agent's turn that adds no page (RetainMany's common case) takes the short way:
    the session's expiry moves, its pages stay pinned once, and a later turn that adds
    pages still adds them."""
    info = store.register_layout(LAYOUT)
    mine = keys("turn", 6)
    put(store, info, mine)
    assert retain(store, info, mine[:4], ttl=10.0).pages == 4
    store.test_clock.now += 8
    got = store.retain_many(info.layout_id, Packed.of(mine),
                            [("s", 10.0, np.array([3, 2, 1, 0]))])
    assert got[0].pages == 4 and not got[0].refused
    assert (store.stats().retained_pages, store.stats().pinned_pages) == (4, 4)
    store.test_clock.now += 8                   # past the first expiry, not the second
    store.expire_leases()
    assert store.stats().retained_pages == 4
    assert retain(store, info, mine, ttl=10.0).pages == 6
    assert (store.stats().retained_pages, store.stats().pinned_pages) == (6, 6)
    assert store.release_retention("s", "default") == 6
    assert store.stats().pinned_pages == 0


def test_held_counts_again_after_a_delete_of_its_pages_and_only_then(store):
    """A session's `held` (each turn's answer) is kept between turns and counted again
    once a delete takes one of its pages; another session's delete leaves it as it was."""
    info = store.register_layout(LAYOUT)
    mine, theirs = keys("held", 5), keys("other", 3)
    put(store, info, mine)
    put(store, info, theirs)
    assert retain(store, info, mine).held == 5
    assert retain(store, info, theirs, session="t").held == 3

    def extend(session):
        return store.retain_many(info.layout_id, Packed.of([]),
                                 [(session, 10.0, np.zeros(0, np.int64))])[0].held

    assert (extend("s"), extend("t")) == (5, 3)
    assert store.delete(info.layout_id, theirs[:1]) == 1
    assert (extend("s"), extend("t")) == (5, 2)
    assert store.delete(info.layout_id, mine[3:]) == 2
    assert (extend("s"), extend("t")) == (3, 2)
    assert retain(store, info, mine[:3]).held == 3
    assert extend("s") == 3
