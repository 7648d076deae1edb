"""Keep glibc from handing large buffers back to the kernel after every message.

Each 1 MiB gRPC message is a fresh Python bytes object. By default glibc serves such a
buffer with mmap (or trims the heap after freeing it), so the next message faults in 256
fresh pages, which held a large Get to about half a raw socket's speed. Raising the mmap
and trim thresholds lets freed buffers be reused from the heap. It matters on the receiving side
(where gRPC allocates each message). The daemon calls it at start; a process that reads
pages over gRPC (a remote client) should call it once too. It changes the allocator for
the whole process, so the client library never calls it by itself. A no-op where
mallopt does not exist (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["keep_freed_buffers", "limit_arenas"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def keep_freed_buffers(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Serve allocations below mmap_threshold from the heap and keep up to trim_threshold
    of freed heap memory; False when this libc has no mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        log.debug("mallopt refused the thresholds; large buffers may be re-faulted")
    return bool(ok)


def limit_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (one per thread by default, up to 8 per core).

    The daemon's gRPC threads each allocate and free message buffers; spread over one
    arena per thread, freed memory kept by keep_freed_buffers piles up per arena, and
    the server's RSS grew through the 8-client load test (bench/load_test.py); capped,
    it stays flat (docs/perf/load-test-4f85f3f71f.json: +0.2% from warm-up to the end).
    The GIL already serialises these threads, so fewer arenas cost no parallelism.
    False when this libc has no mallopt."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(_M_ARENA_MAX, arenas) == 1
