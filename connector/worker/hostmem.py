"""The pool mappings the worker copies through, each registered with CUDA while in use.

An offset the server hands out (Reserve, Acquire) is valid only in the region that server
created: after a restart the same number points at another page, or past the end, of
the old mapping. So the worker never keeps "the pool" of its own; it copies through the
mapping each reservation or acquisition came with (kvstore_client.shm), and this table
registers that mapping on its first use (cudaHostRegister pins every page of it, which
takes time per GiB: docs/perf/load-e21a8ae119.json records it for an 11 GiB pool; so
once per mapping, not per request).

A restart leaves copies in flight on the old mapping (an async load, a save bound before
the restart), so an old registration is closed only at a step boundary when no load or
save still names it (`keep_only`). Not thread-safe: the worker's thread only.
"""

from __future__ import annotations

import numpy as np

from kvstore_client.shm import SharedRegion

from ..transfer import HostRegistration

__all__ = ["Mappings"]


class Mappings:
    """Registered pool mappings, by region (a SharedRegion object is one server's region)."""

    def __init__(self) -> None:
        # id(region) -> (region, its mem as first seen, registration); the region is
        # kept so its id is not reused while the entry lives.
        self._by_region: dict[int, tuple[SharedRegion, np.ndarray, HostRegistration]] = {}

    def mem(self, region: SharedRegion) -> np.ndarray:
        """The region's bytes, registered with CUDA (on first use of this region)."""
        entry = self._by_region.get(id(region))
        if entry is None:
            mem = region.mem
            if not mem.size:
                # The client dropped this mapping (it re-attached to a restarted server)
                # between handing out the offsets and now: they cannot be used.
                raise OSError("the store's pool mapping was closed (the server restarted)")
            entry = (region, mem, HostRegistration(mem))
            self._by_region[id(region)] = entry
        return entry[1]

    def __len__(self) -> int:
        """How many mappings are registered now."""
        return len(self._by_region)

    def keep_only(self, regions) -> None:
        """Close the registrations of every mapping not in `regions` (those still in use)."""
        keep = {id(r) for r in regions}
        for key in [k for k in self._by_region if k not in keep]:
            _, _, registration = self._by_region.pop(key)
            registration.close()

    def close(self) -> None:
        self.keep_only(())
