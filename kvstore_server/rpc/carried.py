"""The context a call carried by the fast path's CALL runs in (carriage.py serves it).

A module of its own because both ends of that call need it: carriage.py, which runs a
KVStoreService method, makes one; service.py, which that method is in, reads who calls
from it (KVStoreService._caller). Kept in carriage.py, the two imported each other.
"""

from __future__ import annotations

import dataclasses

from ..auth import Principal

__all__ = ["Carried"]


@dataclasses.dataclass(frozen=True, slots=True)
class Carried:
    """The context a carried call runs in: who the fast-path connection acts for."""

    who: Principal
