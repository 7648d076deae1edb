"""Reading and writing slots in runs: one preadv or pwritev per run of adjacent slots.

The bytes of one slot (header and payload) are slotfile.py's; this module batches them:
a run is adjacent slots of one file, at most _IOV_MAX buffers and _RUN_BYTES long. The
folder lock that keeps two disk tiers off one set of slot files is here too.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from .slotfile import (
    ALIGN,
    HEADER_BYTES,
    SlotFile,
    SlotHeader,
    aligned_buffer,
    full_io,
    unpack_header,
)

__all__ = ["SlotRead", "SlotWrite", "folder_gone", "lock_folder", "read_slots", "runs_of",
           "write_slots"]

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
# Bytes per preadv/pwritev: longer calls were slower, not faster, on a virtio disk
# (O_DIRECT and plain reads alike), and more threads at once did not help. The tier
# against plain I/O in calls of this size: docs/perf/disk-20302cdf50.json.
_RUN_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class SlotRead:
    """A slot to read: the payload goes to `out`, and the header must equal `expect`."""

    file: SlotFile
    idx: int
    out: np.ndarray             # payload_len bytes, writable
    expect: SlotHeader


@dataclasses.dataclass(frozen=True, slots=True)
class SlotWrite:
    """A sealed slot image (slot_bytes, page-aligned) to write at slot idx of file."""

    file: SlotFile
    idx: int
    image: np.ndarray


def read_slots(reads: Sequence[SlotRead]) -> list[bool | None]:
    """Read and check slots, one preadv per run of adjacent slots: True (intact), False
    (header or payload checksum wrong, or cut off by the end of the file: corrupt) or None
    (the read itself failed: an I/O error, not the page's fault)."""
    # A slot is read whole: the payload straight into the caller's buffer, the rest (slack
    # and header) into scratch. O_DIRECT where the buffer is page-aligned and whole 4 KiB
    # blocks (a DRAM pool slot); through the page cache otherwise.
    direct = [r.file.dfd >= 0 and r.out.nbytes % ALIGN == 0 and r.out.ctypes.data % ALIGN == 0
              for r in reads]
    tail_bytes = [r.file.slot_bytes - r.out.nbytes for r in reads]
    scratch = aligned_buffer(sum(tail_bytes))
    ends = np.cumsum(tail_bytes, dtype=np.int64).tolist()
    tails = [scratch[end - n:end] for n, end in zip(tail_bytes, ends, strict=True)]
    runs = [run for flag in (True, False)
            for run in _runs([j for j in range(len(reads)) if direct[j] == flag],
                             lambda j: (reads[j].file, reads[j].idx), _IOV_MAX // 2)]
    status: list[bool | None] = [None] * len(reads)
    for run in runs:
        file = reads[run[0]].file
        bufs = [buf for j in run for buf in (reads[j].out, tails[j])]
        try:
            got = full_io(os.preadv, file.dfd if direct[run[0]] else file.fd, bufs,
                           file.offset(reads[run[0]].idx))
        except OSError:
            continue
        for k, j in enumerate(run):
            status[j] = ((k + 1) * file.slot_bytes <= got
                         and unpack_header(tails[j][-HEADER_BYTES:]) == reads[j].expect
                         and xxhash.xxh3_64_intdigest(reads[j].out) == reads[j].expect.payload_xxh)
    return status


def write_slots(writes: Sequence[SlotWrite], pwritev: Callable = os.pwritev
                ) -> tuple[list[bool], OSError | None]:
    """Write slot images, one pwritev per run of adjacent slots (O_DIRECT where the file
    has it). Returns which were written and the error that stopped the rest, if any."""
    done = [False] * len(writes)
    for run in _runs(range(len(writes)), lambda j: (writes[j].file, writes[j].idx), _IOV_MAX):
        file = writes[run[0]].file
        bufs = [writes[j].image for j in run]
        try:
            moved = full_io(pwritev, file.dfd if file.dfd >= 0 else file.fd, bufs,
                            file.offset(writes[run[0]].idx))
            if moved < sum(b.nbytes for b in bufs):
                raise OSError(errno.ENOSPC, "short write", file.path)
        except OSError as exc:
            return done, exc
        for j in run:
            done[j] = True
    return done, None


def _runs(items, where: Callable, max_len: int) -> list[list]:
    """Items grouped into runs of adjacent slots of one file (where(item) = (file, idx)),
    in file order, at most max_len and _RUN_BYTES a run (one slot at least)."""
    runs: list[list] = []
    last = None
    for item in sorted(items, key=lambda it: (where(it)[0].slot_bytes, where(it)[1])):
        file, idx = where(item)
        most = min(max_len, max(1, _RUN_BYTES // file.slot_bytes))
        if runs and len(runs[-1]) < most and last == (file, idx - 1):
            runs[-1].append(item)
        else:
            runs.append([item])
        last = (file, idx)
    return runs


def runs_of(slots: list[tuple[SlotFile, int]]) -> list[tuple[SlotFile, int, int]]:
    """(file, first slot, count) for each run of adjacent slots of one file."""
    runs: list[tuple[SlotFile, int, int]] = []
    for file, idx in sorted(slots, key=lambda b: (b[0].slot_bytes, b[1])):
        if runs and runs[-1][0] is file and runs[-1][1] + runs[-1][2] == idx:
            runs[-1] = (file, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((file, idx, 1))
    return runs


def lock_folder(directory: str) -> int:
    """An exclusive lock on the folder for the tier's life: two tiers writing one set of
    slot files would overwrite each other's pages."""
    fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"disk tier folder {directory} is in use by another disk tier "
                           "(another kvstore-server?)") from None
    return fd


def folder_gone(lock_fd: int) -> bool:
    """Whether the folder whose lock_folder() descriptor this is was removed meanwhile:
    its lock file then has no name left. Writes went on into unlinked files, a stop's
    flush said every page was written, and the restart found none."""
    return os.fstat(lock_fd).st_nlink == 0
