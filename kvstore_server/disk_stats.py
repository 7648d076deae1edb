"""The disk tier's numbers: its stats value and the event counters behind it."""

from __future__ import annotations

import dataclasses

from .tier import TierStats

__all__ = ["DiskCounters", "DiskStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class DiskStats(TierStats):
    """The disk tier's counters: TierStats and its queue, restart and I/O mode."""

    pages_by_layout: dict[bytes, int] = dataclasses.field(default_factory=dict)
    queued_pages: int = 0
    queued_bytes: int = 0
    queue_capacity_bytes: int = 0
    rebuilt_pages: int = 0          # found on disk at start
    undurable_deletes: int = 0      # deletes that returned before their slots were blank
    direct_io: bool = False
    rebuild_seconds: float = 0.0


@dataclasses.dataclass(slots=True)
class DiskCounters:
    """Events since start, named fields so that a typo is an error, not a new counter."""

    reads: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    drops: int = 0
    refused: int = 0
    corrupt_pages: int = 0
    read_errors: int = 0
    evictions: int = 0
    rebuilt_pages: int = 0
    undurable_deletes: int = 0
