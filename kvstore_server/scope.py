"""What one invalidation removes (Admin's Invalidate): the argument of `Tier.invalidate`
and of the store's, so it lives below both, not in the far tier that first needed it.

A scope is matched against what a layout is (its id, tenant, model and revision): a
layout the store registered, or the far tier's record of one (far/records.py).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

__all__ = ["LayoutFacts", "Scope"]


class LayoutFacts(Protocol):
    """What a scope is matched against (far.records.LayoutRecord is one)."""

    @property
    def layout_id(self) -> bytes: ...
    @property
    def tenant(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def revision(self) -> str: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Scope:
    """What one invalidation removes: every layout that matches each field given (a
    model, optionally one revision of it; a layout id; a tenant)."""

    model: str = ""
    revision: str = ""
    layout_id: bytes = b""
    tenant: str = ""

    def problems(self) -> list[str]:
        out = []
        if not (self.model or self.layout_id or self.tenant):
            out.append("an invalidation needs a model, a layout id or a tenant")
        if self.revision and not self.model:
            out.append("a revision needs its model")
        if self.layout_id and len(self.layout_id) != 16:
            out.append(f"a layout id is 16 bytes, got {len(self.layout_id)}")
        return out

    def matches(self, record: LayoutFacts) -> bool:
        return ((not self.model or record.model == self.model)
                and (not self.revision or record.revision == self.revision)
                and (not self.layout_id or record.layout_id == self.layout_id)
                and (not self.tenant or record.tenant == self.tenant))

    def describe(self) -> str:
        parts = [f"model {self.model!r}" if self.model else "",
                 f"revision {self.revision!r}" if self.revision else "",
                 f"layout {self.layout_id.hex()}" if self.layout_id else "",
                 f"tenant {self.tenant!r}" if self.tenant else ""]
        return ", ".join(p for p in parts if p)
