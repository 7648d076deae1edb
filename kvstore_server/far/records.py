"""Layout records: what a layout is, written beside its pages in the cluster, so that an
invalidation by model, revision or tenant finds the layouts of the whole fleet.

A far key names its layout only by id (keys.py), a hash of the layout and its tenant: a
server cannot tell from a key which model it belongs to, and cannot list the ids of a
model that only other servers registered. So the writer leaves one small record per
layout in the cluster, in the layout's own first bucket (`<ns>:{<layout id>.00}layout`,
so records spread over the masters as layouts do, and a clear of the layout removes it),
and writes it again at most every REFRESH seconds while it writes that layout's pages
(a record must stay about as warm as its pages under the cluster's LRU eviction).

Why records and not a registry key of the namespace: one registry key lives on one
master, so one hung master would hide every layout, and a maxmemory eviction of that
one key would forget them all. Why not the model in every value's header: an
invalidation would then GET every value of the namespace, and the value format would
change for every server of the fleet.

A record is JSON (small, read by operators with redis-cli too); one that does not parse
is ignored. It is not signed: forging one can only make an invalidation remove pages,
which whoever can write the cluster can do anyway.
"""

from __future__ import annotations

import dataclasses
import json

from ..scope import Scope  # its home; this old path still imports

__all__ = ["REFRESH", "LayoutRecord", "Scope"]

REFRESH = 60.0      # seconds between two writes of one layout's record by one server


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutRecord:
    """Who a layout's pages belong to: the store's layout id (scoped to the tenant)."""

    layout_id: bytes
    tenant: str
    model: str
    revision: str       # the layout's revision where it has one, else its salt

    def encode(self) -> bytes:
        return json.dumps({"v": 1, "layout_id": self.layout_id.hex(), "tenant": self.tenant,
                           "model": self.model, "revision": self.revision}).encode()

    @staticmethod
    def decode(value: bytes) -> LayoutRecord | None:
        try:
            d = json.loads(value)
            record = LayoutRecord(bytes.fromhex(d["layout_id"]), str(d["tenant"]),
                                  str(d["model"]), str(d["revision"]))
        except (ValueError, KeyError, TypeError):
            return None
        return record if len(record.layout_id) == 16 else None

    @staticmethod
    def of(layout_id: bytes, tenant: str, layout) -> LayoutRecord:
        """The record of a registered layout (a kvstore_client PageLayout)."""
        return LayoutRecord(layout_id, tenant, layout.model, revision_of(layout))


def revision_of(layout) -> str:
    """The weights' revision a layout names: its `revision` field where PageLayout has
    one, else its salt (where deployments put the revision until then)."""
    return str(getattr(layout, "revision", "") or layout.salt)
