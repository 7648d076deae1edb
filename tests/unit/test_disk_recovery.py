"""The disk tier across crashes: a restart over capacity, deletes that stay deleted after a
SIGKILL, and a slot whose header is intact but whose length is not what the reader expects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

from kvstore_server.disk.slotfile import slot_bytes_for
from kvstore_server.disk.tier import DiskTier

from .test_disk import LAYOUT, KiB, fill, key, page, read


def test_a_restart_over_capacity_evicts_the_oldest_down_to_it(tiers, tmp_path):
    """A smaller --disk, or freed slots not yet blanked when the server was killed, leave
    more on disk than the capacity: the rebuild evicts the oldest pages and starts (it
    used to raise "cannot notify on un-acquired lock", at every restart)."""
    size = 12 * KiB
    sb = slot_bytes_for(size)
    tier = tiers(capacity=16 * sb)
    ks = [key(i) for i in range(16)]
    fill(tier, ks, size)
    tier.close()
    tier = tiers(capacity=6 * sb, directory=tmp_path / "disk")
    s = tier.stats()
    assert s.pages == 6 and s.used_bytes == 6 * sb and s.evictions == 10
    assert tier.contains(LAYOUT, ks).tolist() == [False] * 10 + [True] * 6   # newest kept
    ok, outs = read(tier, ks[10:], size)
    assert all(ok) and all(np.array_equal(o, page(k, size)) for k, o in zip(ks[10:], outs))
    tier.close()
    # The evicted slots were blanked: the next start finds only what the last one kept.
    tier = tiers(capacity=16 * sb, directory=tmp_path / "disk")
    assert tier.stats().pages == 6 and tier.stats().corrupt_pages == 0


# A child process that blanks slots slowly, so a delete that returned before its slots
# were blanked would be caught by the SIGKILL that follows it.
_SLOW_BLANK = """
import sys, time
from kvstore_server.disk import slotfile
from kvstore_server.disk.tier import DiskTier
from kvstore_server.disk.slotfile import slot_bytes_for
from tests.unit.test_disk import LAYOUT, KiB, fill, key

blank = slotfile.SlotFile.blank
def slow_blank(self, idx, *args):
    time.sleep(0.5)
    return blank(self, idx, *args)
slotfile.SlotFile.blank = slow_blank
"""


def _killed_after(folder, script: str) -> str:
    """Run the slow-blank prelude and `script` (which prints one line, then sleeps) in a
    child; SIGKILL it as soon as it has printed; return what it printed."""
    child = subprocess.Popen([sys.executable, "-c", _SLOW_BLANK + textwrap.dedent(script),
                              str(folder)], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        return child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_a_delete_is_durable_once_it_returns(tmp_path):
    """A page deleted from the disk tier does not come back after a SIGKILL that follows
    the delete's return, however soon."""
    folder = tmp_path / "disk"
    assert _killed_after(folder, """
        tier = DiskTier(sys.argv[1], 64 << 20)
        fill(tier, [key(i) for i in range(8)], 8 * KiB)
        print(tier.delete(LAYOUT, [key(i) for i in range(4)]), flush=True)
        time.sleep(60)
    """) == "4"
    tier = DiskTier(str(folder), 64 << 20)
    try:
        assert tier.contains(LAYOUT, [key(i) for i in range(8)]).tolist() == \
            [False] * 4 + [True] * 4
    finally:
        tier.close()


def test_a_delete_of_an_evicted_page_is_durable_too(tmp_path):
    """A page the tier evicted is gone from its index before its slot is blanked. A delete
    of it then holds nothing here, but the client was told the key is deleted: a SIGKILL
    right after must not bring the page back from its not-yet-blanked slot."""
    folder = tmp_path / "disk"
    # Eight 8 KiB pages fill the tier; one 16 KiB page evicts the two oldest, whose slots
    # (another size class) are freed, not reused: they wait for the writer to blank them.
    assert _killed_after(folder, """
        tier = DiskTier(sys.argv[1], 8 * slot_bytes_for(8 * KiB))
        fill(tier, [key(i) for i in range(8)], 8 * KiB)
        fill(tier, [key(100)], 16 * KiB)
        print(tier.delete(LAYOUT, [key(0), key(1)]), flush=True)
        time.sleep(60)
    """) == "0"
    tier = DiskTier(str(folder), 64 << 20)
    try:
        assert tier.contains(LAYOUT, [key(i) for i in range(8)]).tolist() == \
            [False] * 2 + [True] * 6
        assert tier.contains(LAYOUT, [key(100)]).tolist() == [True]
    finally:
        tier.close()


def test_a_slot_of_the_wrong_length_is_corrupt(tiers, tmp_path):
    """A header that checks out but whose payload length is not the reader's page size
    (a page of another size class written under this key, or a forged file) is dropped
    and counted as corrupt, never raised to the caller."""
    tier = tiers()
    fill(tier, [key(0)], 8 * KiB)
    out = np.empty(6 * KiB, np.uint8)       # same 8 KiB slot class, another length
    assert tier.read_into(LAYOUT, [key(0)], [out]) == [False]
    s = tier.stats()
    assert s.corrupt_pages == 1 and s.pages == 0
    assert not tier.contains(LAYOUT, [key(0)])[0]
