"""The disk tier's on-disk format: one file of equal slots per slot size, a header per slot.

A slot holds one page. The payload comes first and the header last:

    <slot_bytes>.slots, slot i at file offset i * slot_bytes (slot_bytes: a multiple of 4 KiB)

    0                              payload_len              slot_bytes - 128       slot_bytes
    | payload: the page, byte for byte | zero slack ...       | header (128 bytes)    |
    ^ 4 KiB aligned

    header, little-endian:
    0       8         10        12         16            24           32            40
    | magic | version | key_len | reserved | payload_len | generation | payload_xxh |
    40                 56                                 120                128
    | layout_id (16 B) | key (key_len <= 64 bytes, zero-padded) | header_xxh |

    magic        b"KVSTSLOT"
    version      1; a slot of another version is skipped at start (counted as corrupt)
    payload_len  page bytes; at most slot_bytes - 128
    generation   a counter that grows with every write, across restarts: of two slots with
                 the same key the later write wins, and a slot rewritten with another page is
                 never mistaken for the page that was there before
    payload_xxh  xxh3_64 of payload[:payload_len]
    header_xxh   xxh3_64 of header[0:120]: it covers payload_xxh and the generation

Why the header sits at the end: the payload then starts on a 4 KiB boundary, so O_DIRECT can
read it straight into the caller's page-aligned buffer (a DRAM pool slot) with no bounce copy,
and a page that is not a multiple of 4 KiB leaves slack at the end that holds the header for
free: 1 KiB pages take 4 KiB slots. A 1 MiB page takes 1 MiB + 4 KiB (0.4% overhead).

Torn writes. A slot is written with one pwritev (payload, slack and header together), never
synced: the tier is a cache, and a crash may leave any subset of the slot's 4 KiB blocks
new. Every mix is detected: a half-written header fails header_xxh; a new header over an old
or half-written payload, or an old header over a new payload, fails payload_xxh. Headers are
checked when the index is rebuilt at start; payloads when they are read, since reading every
payload at start would mean reading the whole disk.

A slot whose header is all zeros is empty: never written, or freed (its blocks given back
with a punched hole, which also reads as zeros, so a freed page cannot come back at restart).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import mmap
import os
import stat
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

__all__ = ["ALIGN", "BLANK", "CORRUPT", "HEADER_BYTES", "MAX_KEY", "VALID", "ScanResult",
           "SlotFile", "SlotHeader", "aligned_buffer", "full_io", "pack_header",
           "probe_direct", "seal", "slot_bytes_for", "unpack_header"]

ALIGN = 4096                # slot sizes and payload offsets; O_DIRECT needs 512 or 4096
HEADER_BYTES = 128
MAX_KEY = 64
MAGIC = b"KVSTSLOT"
VERSION = 1
SUFFIX = ".slots"

_FIELDS = struct.Struct("<8sHHIQQQ16s64s")      # everything before header_xxh
_CHECKED = _FIELDS.size                          # 120 bytes covered by header_xxh
assert _CHECKED == 120
_XXH = struct.Struct("<Q")
_HEADER_DTYPE = np.dtype([("magic", "S8"), ("version", "<u2"), ("key_len", "<u2"),
                          ("reserved", "<u4"), ("payload_len", "<u8"), ("generation", "<u8"),
                          ("payload_xxh", "<u8"), ("layout_id", "V16"), ("key", "V64"),
                          ("header_xxh", "<u8")])
assert _HEADER_DTYPE.itemsize == HEADER_BYTES

# Header states found by a scan.
BLANK, VALID, CORRUPT = 0, 1, 2

# Slots up to this size are scanned at start by reading the whole file in big sequential
# chunks; larger ones by reading each header alone (reading every payload of 1 MiB pages
# to find their headers would read the whole disk).
_SEQ_SCAN_MAX = 64 << 10
_SCAN_CHUNK = 8 << 20
_SCAN_WINDOW = 4096         # headers of large slots asked for ahead of reading them

_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def slot_bytes_for(page_bytes: int) -> int:
    """The slot size that holds a page of page_bytes and its header."""
    return _round_up(page_bytes + HEADER_BYTES, ALIGN)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed, page-aligned uint8 buffer (an anonymous mapping), usable with O_DIRECT."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


_ZEROS = aligned_buffer(ALIGN)


@dataclasses.dataclass(frozen=True, slots=True)
class SlotHeader:
    layout_id: bytes        # 16 bytes
    key: bytes              # 1..64 bytes
    payload_len: int
    generation: int
    payload_xxh: int


def pack_header(header: SlotHeader, out: np.ndarray) -> None:
    """Write the 128-byte header into out (a writable uint8 view of 128 bytes)."""
    buf = out.data.cast("B")
    _FIELDS.pack_into(buf, 0, MAGIC, VERSION, len(header.key), 0, header.payload_len,
                      header.generation, header.payload_xxh, header.layout_id, header.key)
    _XXH.pack_into(buf, _CHECKED, xxhash.xxh3_64_intdigest(buf[:_CHECKED]))


def unpack_header(buf: np.ndarray) -> SlotHeader | None:
    """The header in buf (128 bytes), or None when it is blank, torn or not ours."""
    view = buf.data.cast("B")
    magic, version, key_len, _, payload_len, gen, pxxh, layout_id, key = _FIELDS.unpack_from(view)
    if magic != MAGIC or version != VERSION or not 1 <= key_len <= MAX_KEY:
        return None
    if _XXH.unpack_from(view, _CHECKED)[0] != xxhash.xxh3_64_intdigest(view[:_CHECKED]):
        return None
    return SlotHeader(layout_id, key[:key_len], payload_len, gen, pxxh)


def seal(slot: np.ndarray, layout_id: bytes, key: bytes, payload_len: int,
         generation: int) -> int:
    """Finish a slot image whose payload is in place: zero the slack, write the header.
    Returns the payload checksum."""
    pxxh = xxhash.xxh3_64_intdigest(slot[:payload_len].data)
    slot[payload_len:-HEADER_BYTES] = 0
    pack_header(SlotHeader(layout_id, key, payload_len, generation, pxxh), slot[-HEADER_BYTES:])
    return pxxh


def probe_direct(directory: str) -> bool:
    """Whether files in directory take O_DIRECT reads and writes (tmpfs and some network
    file systems refuse them)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, ".direct-probe")
    buf = aligned_buffer(ALIGN)
    # A file of our own, made anew: one left there (a symlink to another file, say) is
    # removed, not followed; O_TRUNC through a symlink zeroed its target at every start.
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT,
                     0o600)
    except OSError:
        return False
    try:
        return os.pwritev(fd, [buf.data], 0) == ALIGN and os.preadv(fd, [buf.data], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


@dataclasses.dataclass(slots=True)
class ScanResult:
    """What a file's headers say, one row per whole slot."""

    state: np.ndarray           # BLANK, VALID or CORRUPT per slot
    generation: np.ndarray      # uint64
    payload_len: np.ndarray     # int64
    payload_xxh: np.ndarray     # uint64
    layout_ids: list[bytes | None]
    keys: list[bytes | None]
    torn_tail: bool             # the file ends inside a slot (a write cut short)


class SlotFile:
    """`<slot_bytes>.slots` in the tier's folder: equal slots, grown by writing past the end.

    Two descriptors: `fd` (buffered) and `dfd` (O_DIRECT, or -1 when the file system
    refuses it). Positional I/O only, so threads share them without a lock.
    """

    def __init__(self, directory: str, slot_bytes: int, direct: bool) -> None:
        if slot_bytes % ALIGN or slot_bytes <= HEADER_BYTES:
            raise ValueError(f"slot size {slot_bytes} is not a multiple of {ALIGN}")
        self.slot_bytes = slot_bytes
        self.path = os.path.join(directory, f"{slot_bytes}{SUFFIX}")
        # Not through a symlink: pages spilled through one were written into whatever
        # file it named. ELOOP then, which the caller reports with the file's name.
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise OSError(errno.EINVAL, "not a regular file", self.path)
        self.dfd = (os.open(self.path, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW) if direct
                    else -1)
        size = os.fstat(self.fd).st_size
        self.n_slots = size // slot_bytes       # whole slots in the file now
        self.torn_tail = size % slot_bytes != 0
        self.can_punch = True                   # cleared when the file system says no

    @staticmethod
    def slot_bytes_of(name: str) -> int | None:
        """The slot size a file name stands for, or None if it is not a slot file: only
        the name the tier makes for a size. `069632.slots` (or Arabic-Indic digits) read
        as 69632 too, so the one file was indexed twice, and each page's second sighting,
        taken for an older copy, was blanked: a stray name wiped the tier."""
        stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else ""
        if not (stem.isascii() and stem.isdigit()) or stem != str(int(stem)):
            return None
        size = int(stem)
        return size if size % ALIGN == 0 and size > HEADER_BYTES else None

    def offset(self, idx: int) -> int:
        return idx * self.slot_bytes

    def blank(self, idx: int, pwritev: Callable = os.pwritev, n: int = 1) -> None:
        """Make slots idx..idx+n-1 blank so their pages cannot come back at restart: punch
        a hole (the blocks go back to the file system and read as zeros), or where the
        file system cannot, zero the last block of each, which holds the header. One
        call a run: punching a large delete's slots one by one took seconds."""
        if self.can_punch:
            if _libc.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                               self.offset(idx), n * self.slot_bytes) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise OSError(err, os.strerror(err), self.path)
            self.can_punch = False
        for i in range(idx, idx + n):
            pwritev(self.dfd if self.dfd >= 0 else self.fd, [_ZEROS], self.offset(i + 1) - ALIGN)

    def scan(self) -> ScanResult:
        """Read and check the header of every whole slot."""
        parts = [self._check(raw) for raw in self._header_chunks()]
        state, gens, lens, sums = (np.concatenate([np.zeros(0, dt), *(p[k] for p in parts)])
                                   for k, dt in enumerate((np.uint8, np.uint64, np.int64,
                                                           np.uint64)))
        layout_ids = [lid for p in parts for lid in p[4]]
        keys = [key for p in parts for key in p[5]]
        return ScanResult(state, gens, lens, sums, layout_ids, keys, self.torn_tail)

    def _check(self, raw: np.ndarray) -> tuple:
        """Check a (n, 128) block of headers: (state, generation, payload_len, payload_xxh,
        layout ids, keys), the last two None where not VALID."""
        rows = raw.view(_HEADER_DTYPE).reshape(-1)
        n = len(rows)
        state = np.where(raw.any(axis=1), CORRUPT, BLANK).astype(np.uint8)
        plausible = ((rows["magic"] == MAGIC) & (rows["version"] == VERSION)
                     & (rows["key_len"] >= 1) & (rows["key_len"] <= MAX_KEY)
                     & (rows["payload_len"] <= self.slot_bytes - HEADER_BYTES))
        layout_ids: list[bytes | None] = [None] * n
        keys: list[bytes | None] = [None] * n
        digest = xxhash.xxh3_64_intdigest
        header_xxh = rows["header_xxh"].tolist()
        key_len = rows["key_len"].tolist()
        mem = memoryview(raw.tobytes())      # slicing bytes is ~5x cheaper than numpy rows
        valid = []
        for i in np.flatnonzero(plausible).tolist():
            at = i * HEADER_BYTES
            if digest(mem[at:at + _CHECKED]) == header_xxh[i]:
                valid.append(i)
                layout_ids[i] = bytes(mem[at + 40:at + 56])
                keys[i] = bytes(mem[at + 56:at + 56 + key_len[i]])
        state[valid] = VALID
        return (state, rows["generation"].copy(), rows["payload_len"].astype(np.int64),
                rows["payload_xxh"].copy(), layout_ids, keys)

    def _header_chunks(self):
        """Blocks of (k, 128) headers, in slot order, of every whole slot."""
        n, sb = self.n_slots, self.slot_bytes
        if sb > _SEQ_SCAN_MAX:
            # Large slots: read only the headers. WILLNEED queues the next window's header
            # blocks at once, so the disk sees many reads in flight while the preads that
            # follow mostly hit the page cache (faster than several threads of plain
            # preads); DONTNEED gives the cache back after.
            def ask(lo: int) -> None:
                for i in range(lo, min(n, lo + _SCAN_WINDOW)):
                    os.posix_fadvise(self.fd, (i + 1) * sb - HEADER_BYTES, HEADER_BYTES,
                                     os.POSIX_FADV_WILLNEED)

            ask(0)
            for lo in range(0, n, _SCAN_WINDOW):
                ask(lo + _SCAN_WINDOW)
                out = np.zeros((min(_SCAN_WINDOW, n - lo), HEADER_BYTES), dtype=np.uint8)
                for k in range(len(out)):
                    os.preadv(self.fd, [out[k]], (lo + k + 1) * sb - HEADER_BYTES)
                os.posix_fadvise(self.fd, lo * sb, len(out) * sb, os.POSIX_FADV_DONTNEED)
                yield out
            return
        # Small slots: read the whole file in big sequential chunks (O_DIRECT where it can,
        # so a restart does not fill the page cache), the next chunk read while this one
        # is checked: preadv lets go of the GIL.
        per = max(1, _SCAN_CHUNK // sb)
        fd = self.dfd if self.dfd >= 0 else self.fd
        bufs = [aligned_buffer(per * sb), aligned_buffer(per * sb)]

        def read(first: int) -> np.ndarray:
            k, buf = min(per, n - first), bufs[(first // per) % 2]
            got = full_io(os.preadv, fd, [buf[:k * sb]], first * sb)
            heads = buf[:k * sb].reshape(k, sb)[:, -HEADER_BYTES:].copy()
            heads[got // sb:] = 0           # the file shrank under us: blank
            return heads

        with ThreadPoolExecutor(1) as pool:
            ahead = pool.submit(read, 0) if n else None
            for first in range(0, n, per):
                assert ahead is not None        # submitted for every first < n
                heads = ahead.result()
                ahead = pool.submit(read, first + per) if first + per < n else None
                yield heads

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.dfd = -1


def full_io(call, fd: int, bufs: list, offset: int) -> int:
    """Repeat a positional vector read or write over what a short call left; returns the
    bytes moved, less than asked only when a call moved nothing (end of file, disk full)."""
    views = [memoryview(b).cast("B") for b in bufs]
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        n = call(fd, views, offset + done)
        if n <= 0:
            break
        done += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return done
