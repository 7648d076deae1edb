"""The disk tier in-process: round trips, the write-behind queue, LRU, restart, corruption,
torn writes and a full or failing disk."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time

import numpy as np
import pytest

from kvstore_server.disk.slotfile import HEADER_BYTES, aligned_buffer, slot_bytes_for
from kvstore_server.disk.tier import DiskTier
from kvstore_server.removals import Cause, RemovalRing
from kvstore_server.tier import NullTier, Tier

KiB, MiB = 1 << 10, 1 << 20
LAYOUT = bytes(range(16))
OTHER = bytes(range(16, 32))


def key(i: int, tag: str = "k") -> bytes:
    return f"{tag}-{i}".encode().ljust(16, b"\0")     # trailing NULs are part of the key


def page(k: bytes, size: int) -> np.ndarray:
    """The page stored under key k: its bytes follow from the key, so any read can be
    checked against it."""
    return np.random.default_rng(list(k)).integers(0, 256, size, dtype=np.uint8)


def slot_file(tier: DiskTier, size: int) -> str:
    return os.path.join(tier.directory, f"{slot_bytes_for(size)}.slots")


def fill(tier: DiskTier, keys, size: int, layout: bytes = LAYOUT) -> None:
    """Offer every page, flushing whenever the queue is full, then flush."""
    for k in keys:
        while not tier.offer(layout, k, page(k, size)):
            assert tier.flush(10) == 0 and not tier.stats().failed
    assert tier.flush(10) == 0


def read(tier: DiskTier, keys, size: int, layout: bytes = LAYOUT, aligned: bool = False):
    outs = [aligned_buffer(size) if aligned else np.empty(size, np.uint8) for _ in keys]
    return tier.read_into(layout, keys, outs), outs


class Gate:
    """A pwritev that waits until opened: holds the writer so pages stay queued."""

    def __init__(self):
        self.open = threading.Event()

    def __call__(self, fd, bufs, offset):
        self.open.wait(10)
        return os.pwritev(fd, bufs, offset)


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_two_page_sizes(tiers, direct):
    tier = tiers(direct=direct)
    assert isinstance(tier, Tier) and isinstance(NullTier(), Tier)
    sizes = {"a": 64 * KiB, "b": 5000}           # a whole-block page and a ragged one
    for tag, size in sizes.items():
        fill(tier, [key(i, tag) for i in range(20)], size)
    for tag, size in sizes.items():
        ks = [key(i, tag) for i in range(20)]
        assert tier.contains(LAYOUT, ks).all()
        for aligned in (True, False):
            ok, outs = read(tier, ks[::-1] + ks[:1], size, aligned=aligned)  # any order, repeats
            assert all(ok)
            for k, out in zip(ks[::-1] + ks[:1], outs):
                assert np.array_equal(out, page(k, size))
    assert not tier.contains(OTHER, [key(0, "a")]).any()
    assert tier.read_into(LAYOUT, [b"missing"], [np.empty(1, np.uint8)]) == [False]
    s = tier.stats()
    assert s.pages == 40 and s.writes == 40 and s.corrupt_pages == 0
    assert s.used_bytes == 20 * slot_bytes_for(64 * KiB) + 20 * slot_bytes_for(5000)
    assert s.bytes_written == 20 * (64 * KiB + 5000)
    # A page of another length than the layout's is not this page: dropped as corrupt.
    assert tier.read_into(LAYOUT, [key(0, "a")], [np.empty(10, np.uint8)]) == [False]
    assert tier.stats().corrupt_pages == 1 and not tier.contains(LAYOUT, [key(0, "a")])[0]


def test_queued_pages_are_served_and_a_known_page_is_not_written_twice(tiers):
    gate = Gate()
    tier = tiers(pwritev=gate)
    ks = [key(i) for i in range(4)]
    for k in ks:
        assert tier.offer(LAYOUT, k, memoryview(page(k, 8 * KiB).tobytes()))
    assert tier.contains(LAYOUT, ks).all()
    ok, outs = read(tier, ks, 8 * KiB)            # still queued: read from staging memory
    assert all(ok) and all(np.array_equal(o, page(k, 8 * KiB)) for k, o in zip(ks, outs))
    assert tier.offer(LAYOUT, ks[0], page(ks[0], 8 * KiB))    # queued already: no copy
    gate.open.set()
    assert tier.flush(10) == 0
    assert tier.offer(LAYOUT, ks[0], page(ks[0], 8 * KiB))    # on disk already: no write
    assert tier.flush(10) == 0
    assert tier.stats().writes == 4


def test_full_queue_drops_and_counts(tiers):
    gate = Gate()
    size = 60 * KiB                               # 64 KiB slots; the queue holds four
    tier = tiers(queue_bytes=4 * slot_bytes_for(size), pwritev=gate)
    taken = [tier.offer(LAYOUT, key(i), page(key(i), size)) for i in range(10)]
    assert taken == [True] * 4 + [False] * 6
    assert tier.stats().drops == 6 and tier.stats().queued_pages == 4
    gate.open.set()
    assert tier.flush(10) == 0
    assert tier.contains(LAYOUT, [key(i) for i in range(10)]).tolist() == [True] * 4 + [False] * 6
    assert tier.offer(LAYOUT, key(9), page(key(9), size))     # room again


@pytest.mark.lru_order
def test_lru_eviction_when_over_capacity(tiers):
    size = 12 * KiB                               # 16 KiB slots, 8 fit
    tier = tiers(capacity=8 * slot_bytes_for(size))
    fill(tier, [key(i) for i in range(8)], size)
    assert read(tier, [key(0)], size)[0] == [True]   # key 0 is now the most recent
    fill(tier, [key(i) for i in range(8, 12)], size)
    present = tier.contains(LAYOUT, [key(i) for i in range(12)])
    assert present.tolist() == [True] + [False] * 4 + [True] * 7
    s = tier.stats()
    assert s.evictions == 4 and s.used_bytes <= s.capacity_bytes and s.pages == 8
    ks = [key(i) for i in (0, *range(5, 12))]
    ok, outs = read(tier, ks, size)
    assert all(ok) and all(np.array_equal(o, page(k, size)) for k, o in zip(ks, outs))
    # The victims' slots were reused, so the file did not grow past the capacity.
    assert os.path.getsize(slot_file(tier, size)) == 8 * slot_bytes_for(size)


def test_delete_and_evict(tiers, tmp_path):
    size = 4 * KiB
    tier = tiers()
    fill(tier, [key(i) for i in range(10)], size)
    fill(tier, [key(i) for i in range(5)], size, layout=OTHER)
    assert tier.delete(LAYOUT, [key(0), key(1), b"never"]) == 2
    assert tier.evict(nbytes=1) == (1, slot_bytes_for(size))            # LRU: key 2
    assert not tier.contains(LAYOUT, [key(2)])[0]
    assert tier.evict(layout_id=OTHER) == (5, 5 * slot_bytes_for(size))
    assert tier.stats().pages == 7
    tier.close()
    # Deleted and evicted pages were blanked on disk: they do not come back at restart.
    tier = tiers(directory=tmp_path / "disk")
    assert tier.contains(LAYOUT, [key(i) for i in range(10)]).tolist() == [False] * 3 + [True] * 7
    assert tier.stats().pages == 7 and tier.stats().corrupt_pages == 0
    assert tier.evict(everything=True)[0] == 7 and tier.stats().used_bytes == 0


def test_restart_rebuilds_the_index_and_the_later_generation_wins(tiers, tmp_path):
    # Slots up to 64 KiB are scanned by reading whole files, larger ones header by header.
    sizes = {"a": 20 * KiB, "b": 3000, "c": 100 * KiB}
    tier = tiers()
    for tag, size in sizes.items():
        fill(tier, [key(i, tag) for i in range(50)], size)
    # Make a duplicate: key a-0's first slot, saved, is put back after a newer write.
    path, sb = slot_file(tier, 20 * KiB), slot_bytes_for(20 * KiB)
    with open(path, "rb") as f:
        old = f.read(sb)                          # slot 0: a-0, generation 1
    tier.delete(LAYOUT, [key(0, "a")])
    fill(tier, [key(0, "x")], 20 * KiB)           # takes the freed slot 0
    newer = page(key(0, "a"), 20 * KiB)[::-1].copy()
    assert tier.offer(LAYOUT, key(0, "a"), newer) and tier.flush(10) == 0
    tier.close()
    with open(path, "r+b") as f:                  # a-0 twice: generation 1 and the newest
        f.write(old)
    tier = tiers(directory=tmp_path / "disk")
    s = tier.stats()
    assert s.pages == 150 and s.rebuilt_pages == 150 and s.corrupt_pages == 0
    ok, outs = read(tier, [key(0, "a")], 20 * KiB)
    assert ok == [True] and np.array_equal(outs[0], newer)
    for tag, size in sizes.items():
        ks = [key(i, tag) for i in range(1, 50)]
        ok, outs = read(tier, ks, size)
        assert all(ok) and all(np.array_equal(o, page(k, size)) for k, o in zip(ks, outs))
    assert not tier.contains(LAYOUT, [key(0, "x")])[0]     # overwritten by the old copy
    # New writes continue the generations: a rewrite after this restart wins the next one.
    tier.delete(LAYOUT, [key(1, "a")])
    fill(tier, [key(1, "a")], 20 * KiB)
    tier.close()
    tier = tiers(directory=tmp_path / "disk")
    assert read(tier, [key(1, "a")], 20 * KiB)[0] == [True]


@pytest.mark.parametrize("size", [8 * KiB, 100 * KiB])   # both ways of scanning headers
def test_random_byte_flips_never_return_a_wrong_page(tiers, tmp_path, size):
    rng = np.random.default_rng(7)
    n = 64
    sb = slot_bytes_for(size)
    tier = tiers()
    ks = [key(i) for i in range(n)]
    fill(tier, ks, size)
    tier.close()
    path = slot_file(tier, size)
    data = np.fromfile(path, dtype=np.uint8)
    hit = set()
    for pos in rng.choice(len(data), 40, replace=False).tolist():
        data[pos] ^= rng.integers(1, 256)
        if pos % sb < size or pos % sb >= sb - HEADER_BYTES:    # the slack is not checked
            hit.add(pos // sb)
    data.tofile(path)
    tier = tiers(directory=tmp_path / "disk")
    ok, outs = read(tier, ks, size)
    for k, good, out in zip(ks, ok, outs):
        assert not good or np.array_equal(out, page(k, size))
    assert sum(not g for g in ok) == len(hit) and len(hit) > 10
    assert tier.stats().corrupt_pages == len(hit)
    assert tier.stats().pages == n - len(hit)          # corrupt pages left the index
    assert read(tier, ks, size)[0] == ok                  # and stay missing


def test_flips_under_a_running_tier_are_caught_on_read(tiers):
    size = 16 * KiB
    tier = tiers()
    ks = [key(i) for i in range(8)]
    fill(tier, ks, size)
    sb = slot_bytes_for(size)
    fd = os.open(slot_file(tier, size), os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff", 2 * sb + 100)                   # slot 2: payload
        os.pwrite(fd, bytes(HEADER_BYTES), 5 * sb - HEADER_BYTES)  # slot 4: header zeroed
    finally:
        os.close(fd)
    for aligned in (True, False):
        ok, outs = read(tier, ks, size, aligned=aligned)
        assert all(np.array_equal(o, page(k, size)) for k, o, g in zip(ks, outs, ok) if g)
    assert [not g for g in read(tier, ks, size)[0]] == [i in (2, 4) for i in range(8)]
    assert tier.stats().corrupt_pages == 2


def test_torn_writes_are_detected(tiers, tmp_path):
    size = 16 * KiB
    sb = slot_bytes_for(size)
    tier = tiers()
    ks = [key(i) for i in range(8)]
    fill(tier, ks, size)
    tier.close()
    path = slot_file(tier, size)
    with open(path, "r+b") as f:
        f.truncate(5 * sb + sb // 2)              # a crash while slot 5 was being written
        f.seek(1 * sb)                            # slot 1: new header, half-written payload
        f.write(bytes(size // 2))
        f.seek(3 * sb - HEADER_BYTES)             # slot 2: header half written
        f.write(bytes(HEADER_BYTES // 2))
    tier = tiers(directory=tmp_path / "disk")
    assert tier.stats().corrupt_pages == 2     # slot 2's header and the cut-off slot 5
    ok, outs = read(tier, ks, size)
    assert ok == [True, False, False, True, True, False, False, False]
    assert all(np.array_equal(o, page(k, size)) for k, o, g in zip(ks, outs, ok) if g)
    assert tier.stats().corrupt_pages == 3     # slot 1 caught by its payload checksum
    fill(tier, [key(i, "new") for i in range(4)], size)   # the torn slots are reused
    assert all(read(tier, [key(i, "new") for i in range(4)], size)[0])


class FailAfter:
    """A pwritev that fails with errno after `calls` successful calls."""

    def __init__(self, calls: int, err: int):
        self.calls, self.err = calls, err

    def __call__(self, fd, bufs, offset):
        if self.calls <= 0:
            raise OSError(self.err, os.strerror(self.err))
        self.calls -= 1
        return os.pwritev(fd, bufs, offset)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_write_errors_stop_the_tier_and_reads_go_on(tiers, err, caplog):
    size = 8 * KiB
    tier = tiers(pwritev=FailAfter(2, err))
    first = [key(i) for i in range(2)]
    for k in [*first, key(2), key(3)]:            # one page a flush: one pwritev each
        tier.offer(LAYOUT, k, page(k, size))
        tier.flush(10)
    s = tier.stats()
    assert s.failed and os.strerror(err) in s.error and s.pages == 2
    assert s.refused == 2 and s.queued_pages == 0
    assert not tier.offer(LAYOUT, key(99), page(key(99), size))
    ok, outs = read(tier, first, size)
    assert all(ok) and all(np.array_equal(o, page(k, size)) for k, o in zip(first, outs))
    assert tier.delete(LAYOUT, first[:1]) == 1
    assert sum("stops taking pages" in r.message for r in caplog.records) == 1


def test_a_full_file_system_stops_the_tier(tiers, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(mnt)],
                          check=False, capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a 2 MiB tmpfs to fill (needs root or CAP_SYS_ADMIN): "
                    f"{done.stderr.strip()}")
    try:
        size = 64 * KiB
        tier = tiers(capacity=64 * MiB, directory=mnt)    # more than the file system holds
        ks = [key(i) for i in range(64)]                   # 4 MiB of pages
        for k in ks:
            tier.offer(LAYOUT, k, page(k, size))
            tier.flush(10)
        s = tier.stats()
        assert s.failed and "No space" in s.error
        assert 10 < s.pages < 32
        held = [k for k in ks if tier.contains(LAYOUT, [k])[0]]
        ok, outs = read(tier, held, size)
        assert all(ok) and all(np.array_equal(o, page(k, size)) for k, o in zip(held, outs))
        assert not tier.offer(LAYOUT, key(100), page(key(100), size))
        tier.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_readers_never_see_a_reused_slot(tiers):
    """Reads race with writes that evict and overwrite slots: a read pins its slots, so
    every page it returns is the right one."""
    size = 8 * KiB
    tier = tiers(capacity=16 * slot_bytes_for(size), queue_bytes=MiB)
    stop = threading.Event()
    bad = []

    def reader(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            ks = [key(int(i)) for i in rng.integers(0, 200, 8)]
            ok, outs = read(tier, ks, size, aligned=bool(seed % 2))
            bad.extend(k for k, g, o in zip(ks, ok, outs)
                       if g and not np.array_equal(o, page(k, size)))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(400):
            tier.offer(LAYOUT, key(i % 200), page(key(i % 200), size))
            if i % 16 == 0:
                tier.flush(10)
    finally:
        stop.set()
        for t in threads:
            t.join()
    s = tier.stats()
    assert not bad and s.corrupt_pages == 0 and s.used_bytes <= s.capacity_bytes


def test_one_tier_per_folder(tiers, tmp_path):
    tiers()
    with pytest.raises(RuntimeError, match="in use"):
        DiskTier(str(tmp_path / "disk"), MiB)


@pytest.mark.slow
def test_restart_of_100k_pages(tiers, tmp_path):
    """100k pages of 1 KiB (4 KiB slots: 400 MiB of files) come back after a restart; it
    prints the rate (disk/tier.py's docstring: a rebuild is bound by the disk)."""
    size, n = 1 * KiB, 100_000
    tier = tiers(capacity=512 * MiB)
    ks = [i.to_bytes(8, "little") for i in range(n)]
    base = np.arange(size, dtype=np.uint8)
    for i, k in enumerate(ks):
        while not tier.offer(LAYOUT, k, np.roll(base, i % size)):
            tier.flush(10)
    assert tier.flush(60) == 0
    tier.close()
    started = time.perf_counter()
    tier = tiers(capacity=512 * MiB, directory=tmp_path / "disk")
    took = time.perf_counter() - started
    print(f"\nrebuilt {n} pages in {took:.2f} s: {n / took:,.0f} pages/s")
    assert tier.stats().pages == n
    sample = np.random.default_rng(0).choice(n, 256, replace=False).tolist()
    outs = [np.empty(size, np.uint8) for _ in sample]
    assert all(tier.read_into(LAYOUT, [ks[i] for i in sample], outs))
    assert all(np.array_equal(o, np.roll(base, i % size)) for i, o in zip(sample, outs))


def _removed(ring: RemovalRing) -> list[tuple[bytes, int]]:
    got = ring.read([LAYOUT], 0, ring.epoch)
    sizes = list(got.key_sizes)
    keys, at = [], 0
    for n in sizes:
        keys.append(got.keys[at:at + n])
        at += n
    return list(zip(keys, list(got.causes), strict=True))


def test_pages_the_tier_evicts_with_nothing_below_are_recorded_removed(tiers, tmp_path):
    """The disk tier is the host's last: what it evicts for room leaves the server
    (kvstore_server.removals); with a tier below that takes its victims, nothing does."""
    size = 64 * KiB
    ring = RemovalRing(64)
    tier = tiers(capacity=4 * slot_bytes_for(size), removals=ring)
    fill(tier, [key(i) for i in range(6)], size)
    gone = _removed(ring)
    assert len(gone) == 2 and {c for _, c in gone} == {Cause.EVICTED}
    assert not any(read(tier, [k for k, _ in gone], size)[0])

    linked_ring = RemovalRing(64)
    linked = tiers(capacity=4 * slot_bytes_for(size), directory=tmp_path / "linked",
                   removals=linked_ring)
    below = tiers(directory=tmp_path / "below")
    linked.link(below)
    ks = [key(i) for i in range(6)]
    for k in ks:                                # one page a round: each victim goes below
        fill(linked, [k], size)
        below.flush(10)
    # Every page is held on the host or recorded removed, never both: the victims went
    # below (a page the tier had no room left to write is removed).
    removed = {k for k, _ in _removed(linked_ring)}
    held = linked.contains(LAYOUT, ks) | below.contains(LAYOUT, ks)
    assert [k in removed for k in ks] == [not h for h in held.tolist()]
    assert below.contains(LAYOUT, ks).sum() >= 1


def test_pages_lost_to_a_write_error_are_recorded_removed(tiers):
    """The write that fails and the pages queued behind it (dropped when the tier stops
    taking pages) all leave the host."""

    class GateThenFail(Gate):
        def __call__(self, fd, bufs, offset):
            self.open.wait(10)
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    size = 8 * KiB
    ring = RemovalRing(64)
    gate = GateThenFail()
    tier = tiers(pwritev=gate, removals=ring)
    ks = [key(i) for i in range(6)]
    for k in ks:                                # the writer holds one batch, the rest queue
        assert tier.offer(LAYOUT, k, page(k, size))
    gate.open.set()
    tier.flush(10)
    assert tier.stats().failed
    assert sorted(k for k, _ in _removed(ring)) == sorted(ks)
