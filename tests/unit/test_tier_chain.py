"""TierChain: tiers stacked below DRAM that the store sees as one (disk, then far).

Two disk tiers stand in for disk and far: both implement the same Tier interface, which
is all the chain and the store see."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_server.disk.tier import DiskTier
from kvstore_server.tier import NullTier, Tier, TierChain

MiB = 1 << 20
LAYOUT = bytes(range(16))
SIZE = 8192


def key(i: int) -> bytes:
    return f"chain-{i}".encode().ljust(16, b"\0")


def page(i: int) -> np.ndarray:
    return np.full(SIZE, i % 251, dtype=np.uint8)


@pytest.fixture
def tiers(tmp_path):
    made = [DiskTier(str(tmp_path / name), 16 * MiB) for name in ("near", "far")]
    yield made
    for tier in made:
        tier.close()


def test_the_chain_is_a_tier_and_drops_null_tiers(tiers):
    chain = TierChain([tiers[0], NullTier(), tiers[1]])
    assert isinstance(chain, Tier) and chain.holds_pages
    assert chain.tiers == tuple(tiers)
    assert not TierChain([NullTier()]).holds_pages
    assert [s.name for s in chain.levels()] == ["disk", "disk"]


def test_a_spill_stops_at_the_top_tier_and_a_read_from_below_is_offered_up(tiers):
    near, far = tiers
    chain = TierChain(tiers)
    assert near.below is far and far.below is None
    assert chain.offer(LAYOUT, key(0), page(0))
    assert chain.flush(10) == 0
    assert near.contains(LAYOUT, [key(0)])[0] and not far.contains(LAYOUT, [key(0)])[0]
    # A page only the far tier holds: found through the chain, then copied up.
    assert far.offer(LAYOUT, key(1), page(1)) and far.flush(10) == 0
    assert chain.contains(LAYOUT, [key(0), key(1), key(2)]).tolist() == [True, True, False]
    outs = [np.empty(SIZE, np.uint8) for _ in range(3)]
    assert chain.read_into(LAYOUT, [key(0), key(1), key(2)], outs) == [True, True, False]
    assert np.array_equal(outs[1], page(1))
    assert chain.flush(10) == 0
    assert near.contains(LAYOUT, [key(1)])[0]          # promoted into the tier above
    assert chain.describe(LAYOUT, key(1)).tier == "disk"


def test_a_page_reaches_the_tier_below_when_the_one_above_lets_it_go(tmp_path):
    # "evict: pages go to the far tier when they leave this host": with a disk tier that
    # is when the disk tier evicts them to make room, or refuses them, not before.
    near = DiskTier(str(tmp_path / "near"), 4 * SIZE * 2, queue_bytes=64 << 10)
    far = DiskTier(str(tmp_path / "far"), 16 * MiB)
    chain = TierChain([near, far])
    try:
        for i in range(4):
            assert chain.offer(LAYOUT, key(i), page(i))
            assert chain.flush(10) == 0
        assert not far.contains(LAYOUT, [key(i) for i in range(4)]).any()
        for i in range(4, 16):                         # near holds ~4 slots: it evicts
            assert chain.offer(LAYOUT, key(i), page(i))
            assert chain.flush(10) == 0
        keys = [key(i) for i in range(16)]
        in_near, in_far = near.contains(LAYOUT, keys), far.contains(LAYOUT, keys)
        assert (in_near | in_far).all() and in_far[:4].all() and in_near[-1]
        outs = [np.empty(SIZE, np.uint8) for _ in keys]
        assert far.read_into(LAYOUT, [k for k, f in zip(keys, in_far) if f],
                             [o for o, f in zip(outs, in_far) if f]) == [True] * int(in_far.sum())
        assert all(np.array_equal(o, page(i)) for i, (o, f) in enumerate(zip(outs, in_far)) if f)
        # A page the tier above refuses (bigger than its whole queue) goes below at once.
        big = np.full(128 << 10, 7, np.uint8)
        assert chain.offer(LAYOUT, key(99), big) and chain.flush(10) == 0
        assert far.contains(LAYOUT, [key(99)])[0] and not near.contains(LAYOUT, [key(99)])[0]
    finally:
        near.close()
        far.close()


def test_delete_counts_a_page_once_and_forgets_it_everywhere(tiers):
    chain = TierChain(tiers)
    for i in range(3):
        chain.offer(LAYOUT, key(i), page(i))
    chain.flush(10)
    assert chain.delete(LAYOUT, [key(0), key(1), key(9)]) == 2
    assert chain.contains(LAYOUT, [key(0), key(1), key(2)]).tolist() == [False, False, True]
    assert not any(t.contains(LAYOUT, [key(0)])[0] for t in tiers)
    assert chain.evict(everything=True)[0] == 1        # key 2, in the top tier only


def test_a_store_over_a_chain_spills_to_the_top_and_promotes_from_below(tiers):
    from kvstore_protocol.layout import PageLayout
    from kvstore_server.region import Region
    from kvstore_server.store import Store

    near, far = tiers
    layout = PageLayout(model="chain", num_layers=1, page_tokens=16, num_kv_heads=8,
                        head_size=128)                           # 64 KiB pages
    region = Region(16 * MiB)
    try:
        store = Store(region, lower=TierChain(tiers))
        info = store.register_layout(layout)
        ks = [key(i) for i in range(4)]
        res = store.reserve(info.layout_id, ks)
        for i, off in enumerate(res.offsets.tolist()):
            store.mem[off:off + info.page_bytes] = i + 1
        store.commit(res.lease_id)
        assert store.evict(everything=True)[0] == 4              # spilled to the top tier
        assert store.lower.flush(10) == 0
        assert near.contains(info.layout_id, ks).all()
        assert not far.contains(info.layout_id, ks).any()
        for k in ks[:2]:                                         # only far holds 0 and 1
            far.offer(info.layout_id, k, near_page(near, info, k))
        assert far.flush(10) == 0
        near.delete(info.layout_id, ks[:2])
        pinned = store.acquire(info.layout_id, ks)
        off = int(pinned.offsets[1])
        assert store.mem[off:off + 4].tolist() == [2] * 4        # key 1, read back from far
        store.release(pinned.lease_id)
        assert [s.name for s in store.stats().tiers] == ["disk", "disk"]
    finally:
        region.close()


def near_page(tier, info, k):
    out = np.empty(info.page_bytes, np.uint8)
    assert tier.read_into(info.layout_id, [k], [out]) == [True]
    return out


class Below(NullTier):
    """Records what the tier above hands down, as the far tier's queue would take it."""

    holds_pages = True

    def __init__(self) -> None:
        self.got: dict[bytes, bytes] = {}

    def offer(self, layout_id, key, page) -> bool:
        self.got[key] = bytes(memoryview(page).cast("B"))
        return True


def test_a_page_corrupt_on_disk_is_never_handed_down(tmp_path):
    import os

    from kvstore_server.disk.slotfile import slot_bytes_for

    near, below = DiskTier(str(tmp_path / "near"), 4 * slot_bytes_for(SIZE)), Below()
    chain = TierChain([near, below])
    try:
        for i in range(4):                              # slots 0..3 of a fresh file
            assert chain.offer(LAYOUT, key(i), page(i)) and chain.flush(10) == 0
        sb = slot_bytes_for(SIZE)
        fd = os.open(os.path.join(near.directory, f"{sb}.slots"), os.O_RDWR)
        try:
            os.pwrite(fd, b"\xfe", 1 * sb + 10)         # key 1's payload
        finally:
            os.close(fd)
        for i in range(4, 8):                           # evicts keys 0..3
            assert chain.offer(LAYOUT, key(i), page(i)) and chain.flush(10) == 0
        assert sorted(below.got) == sorted([key(0), key(2), key(3)])
        assert all(below.got[key(i)] == page(i).tobytes() for i in (0, 2, 3))
    finally:
        near.close()


class Linked(NullTier):
    """A tier of its own kind: it asks for big probes and learns the tier below it."""

    holds_pages = True
    probe_chunk = 4096

    def __init__(self) -> None:
        self.linked: Tier | None = None

    def link(self, below: Tier) -> None:
        self.linked = below


def test_the_chain_links_and_probes_any_tier_through_the_protocol():
    top, bottom, further = Linked(), Linked(), Linked()
    chain = TierChain([top, NullTier(), bottom])
    assert top.linked is bottom and bottom.linked is None
    assert chain.tiers == (top, bottom) and chain.probe_chunk == 4096
    chain.link(further)                                 # a chain below a chain
    assert bottom.linked is further
    null = NullTier()
    assert isinstance(null, Tier) and null.tiers == (null,) and not null.holds_pages
    assert null.invalidate(None, [LAYOUT]).layout_ids == (LAYOUT,)
