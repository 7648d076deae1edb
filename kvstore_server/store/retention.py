"""Session retention: which DRAM pages tenants' sessions keep from eviction, until when.
A pure table, not thread-safe (the store's lock guards it; sessions.py applies it).

Why: an agent's session comes back every few seconds or minutes with the same growing
prefix, and between its turns other tenants' traffic may push that prefix out of DRAM;
the next turn then recomputes it (or reads it from disk). A session may ask that its
prefix be kept for a time (its TTL). A retention is a long lease that eviction respects:
each page a session retains carries one pin of that session (the same pin count leases
use, so every eviction path already passes it over), until the TTL lapses, the session is
released, or an admin breaks it.

Bounds, since a pin is memory taken from every other tenant:
- a tenant's retained pages may take at most its retention quota (bytes of slots; each
  page counted once, however many of its sessions retain it): past it a retain is
  refused, counted, and the tenant's request is still served;
- a tenant may hold at most `max_sessions` sessions, and its sessions may name at most
  MAX_ENTRIES pages between them: a page is charged to the quota once however many
  sessions keep it (agents share a system prompt), but each session's list of it costs
  the server 16 bytes, so 1,024 sessions each naming the same 650k pages would take 10 GB;
- a request names at most RequestLimits' keys, so one retain is bounded work (and the
  session's own list: a set difference over it).

Retention never blocks a delete: a page deleted (or invalidated, or cleared) while
retained leaves every session that held it (forget), and its slot's generation moves on,
so a session that ends later does not unpin the slot's next page.

DRAM only: a retained page stays in DRAM, so the disk tier's copy of it (if any) is not
needed while the retention lasts, and pages already on a tier below are not read back to
be retained (a retain counts the prefix's leading run in DRAM).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
from collections.abc import Callable

import numpy as np

__all__ = ["DEFAULT_MAX_SESSIONS", "DEFAULT_RETENTION_QUOTA", "MAX_ENTRIES",
           "MAX_SESSION_NAME", "MAX_TTL", "RetainOutcome", "RetentionLimits", "RetentionTable"]

# A tenant's retention quota by default: a tenth of the pool. Retained pages are taken
# out of the LRU for everyone else; a tenth leaves the other nine to the watermarks'
# eviction (0.85-0.95 of the pool) and to leases.
DEFAULT_RETENTION_QUOTA = 0.1
DEFAULT_MAX_SESSIONS = 1024     # sessions one tenant may hold at once
MAX_SESSION_NAME = 128          # characters of a session's name
MAX_TTL = 24 * 3600.0           # seconds a retention may ask for at most
MAX_ENTRIES = 4 << 20           # (session, page) pairs of one tenant: 64 MiB of lists

Sizes = Callable[[np.ndarray], np.ndarray]      # bytes each of these slots takes


class RetainOutcome(enum.Enum):
    RETAINED = "retained"
    OFF = "retention is off on this server (--retention-quota 0)"
    OVER_QUOTA = "over the tenant's retention quota"
    TOO_MANY_SESSIONS = "the tenant holds its most sessions"
    TOO_MANY_ENTRIES = "the tenant's sessions name their most pages"


@dataclasses.dataclass(frozen=True, slots=True)
class RetentionLimits:
    """quota: a tenant's retained bytes, as a share of the pool (at most 1) or bytes
    (above 1); 0 = retention off. max_sessions: sessions a tenant may hold."""

    quota: float = DEFAULT_RETENTION_QUOTA
    max_sessions: int = DEFAULT_MAX_SESSIONS

    def quota_bytes(self, pool_bytes: int, tenant_quota: int = 0) -> int:
        """A tenant's retention quota; tenant_quota: the bytes it may store (0 =
        unlimited), of which it retains at most half, or its retained pages could leave
        its new ones no room (a Put at its quota evicts its own unpinned pages only)."""
        mine = int(self.quota * pool_bytes) if self.quota <= 1 else int(self.quota)
        return min(mine, tenant_quota // 2) if tenant_quota else mine


@dataclasses.dataclass(slots=True)
class _Session:
    tenant: int                 # the table's index of its tenant
    slots: np.ndarray           # int64 slot ids it pins, distinct, sorted
    gens: np.ndarray            # each slot's generation when retained (see forget)
    expires_at: float
    # Its slots still holding their pages, as counted when the table's forgets stood at
    # held_at (RetentionTable.held: counted again only after a forget).
    held: int = 0
    held_at: int = -1


class RetentionTable:
    """Sessions by (tenant, name), the earliest expiry found in O(log n), and per slot how
    many sessions retain it."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[str, str], _Session] = {}
        # (expires_at, order, key): a session retained again leaves a stale entry,
        # skipped when popped (its expires_at no longer matches)
        self._heap: list[tuple[float, int, tuple[str, str]]] = []
        self._order = itertools.count()
        self._tenants: dict[str, int] = {}          # tenant -> index into the arrays below
        self._bytes = np.zeros(0, dtype=np.int64)   # retained bytes per tenant index
        self._count_of = np.zeros(0, dtype=np.int64)   # sessions per tenant index
        self._entries = np.zeros(0, dtype=np.int64)    # their slots, per tenant index
        self.refused_of = np.zeros(0, dtype=np.int64)  # retains refused per tenant index
        # Per slot id (grown on demand): sessions retaining it, its generation (moved on
        # when a retained page leaves DRAM), its tenant index and the bytes charged.
        self.count = np.zeros(0, dtype=np.int32)
        self._gen = np.zeros(0, dtype=np.int64)
        self._owner = np.zeros(0, dtype=np.int32)
        self._charged = np.zeros(0, dtype=np.int64)
        # forget() calls that moved a retained slot's generation: a session's held count
        # stands until the next one (each turn's retain answers it; most delete nothing).
        self._forgets = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def pages(self) -> int:
        """Distinct slots retained (a scan: for stats, not the request path)."""
        return int(np.count_nonzero(self.count))

    def refused(self) -> int:
        return int(self.refused_of.sum())

    def by_tenant(self) -> dict[str, tuple[int, int, int]]:
        """tenant -> (retained bytes, sessions, retains refused)."""
        return {name: (int(self._bytes[i]), int(self._count_of[i]), int(self.refused_of[i]))
                for name, i in self._tenants.items()}

    def _tenant(self, name: str) -> int:
        i = self._tenants.get(name)
        if i is None:
            i = self._tenants[name] = len(self._tenants)
            for field in ("_bytes", "_count_of", "_entries", "refused_of"):
                setattr(self, field, np.append(getattr(self, field), 0))
        return i

    def _grow(self, top: int) -> None:
        if top <= len(self.count):
            return
        size = max(top, 2 * len(self.count), 1024)
        for field in ("count", "_gen", "_owner", "_charged"):
            old = getattr(self, field)
            new = np.zeros(size, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, field, new)

    def retain(self, tenant: str, name: str, slots: np.ndarray, sizes: Sizes, now: float,
               ttl: float, limits: RetentionLimits, pool_bytes: int, tenant_quota: int = 0
               ) -> tuple[RetainOutcome, np.ndarray]:
        """Add slots to the session (made if new) and set its expiry to now + ttl.
        Returns the outcome and the slots newly retained by it, which the caller pins
        once each; a refusal changes nothing but the tenant's refusal count."""
        t = self._tenant(tenant)
        key = (tenant, name)
        session = self._sessions.get(key)
        quota = limits.quota_bytes(pool_bytes, tenant_quota)
        outcome = RetainOutcome.RETAINED
        if not limits.quota:
            outcome = RetainOutcome.OFF
        elif session is None and self._count_of[t] >= limits.max_sessions:
            outcome = RetainOutcome.TOO_MANY_SESSIONS
        slots = np.unique(np.asarray(slots, dtype=np.int64))
        self._grow(int(slots.max()) + 1 if slots.size else 0)
        have = self._live(session) if session is not None else slots[:0]
        if (outcome is RetainOutcome.RETAINED and session is not None
                and np.array_equal(slots, have)):
            # The same pages again (an agent's turn that added none): only the expiry
            # moves. A session's slots are kept sorted, as unique returns them.
            self._expire_at(key, session, now + ttl)
            return outcome, slots[:0]
        new = np.setdiff1d(slots, have, assume_unique=True)
        first = new[self.count[new] == 0]
        charge = sizes(first).astype(np.int64)
        if outcome is RetainOutcome.RETAINED and self._bytes[t] + int(charge.sum()) > quota:
            outcome = RetainOutcome.OVER_QUOTA
        elif outcome is RetainOutcome.RETAINED and self._entries[t] + len(new) > MAX_ENTRIES:
            outcome = RetainOutcome.TOO_MANY_ENTRIES
        if outcome is not RetainOutcome.RETAINED:
            self.refused_of[t] += 1
            return outcome, slots[:0]
        self.count[new] += 1
        self._owner[first] = t
        self._charged[first] = charge
        self._bytes[t] += int(charge.sum())
        if session is None:
            self._count_of[t] += 1
            session = self._sessions[key] = _Session(t, have, have, 0.0)
        self._entries[t] += len(have) + len(new) - len(session.slots)
        session.slots = np.union1d(have, new)
        session.gens = self._gen[session.slots]
        session.held, session.held_at = len(session.slots), self._forgets
        self._expire_at(key, session, now + ttl)
        return outcome, new

    def extend(self, tenant: str, name: str, until: float) -> bool:
        """Move an existing session's expiry to `until`; False if there is no such one."""
        key = (tenant, name)
        session = self._sessions.get(key)
        if session is None:
            return False
        self._expire_at(key, session, until)
        return True

    def held(self, tenant: str, name: str) -> int:
        """Pages the session keeps now (0: no such session)."""
        session = self._sessions.get((tenant, name))
        if session is None:
            return 0
        if session.held_at != self._forgets:
            session.held = int(np.count_nonzero(self._gen[session.slots] == session.gens))
            session.held_at = self._forgets
        return session.held

    def _expire_at(self, key: tuple[str, str], session: _Session, when: float) -> None:
        session.expires_at = when
        heapq.heappush(self._heap, (when, next(self._order), key))
        if len(self._heap) > 2 * len(self._sessions) + 64:
            # A session retained again each turn leaves its earlier entry behind: rebuilt
            # from the live sessions, the heap stays within twice their number.
            self._heap = [(s.expires_at, next(self._order), k)
                          for k, s in self._sessions.items()]
            heapq.heapify(self._heap)

    def _live(self, session: _Session) -> np.ndarray:
        """The session's slots still holding the pages it retained."""
        return session.slots[self._gen[session.slots] == session.gens]

    def _end(self, key: tuple[str, str]) -> np.ndarray:
        """Drop a session; returns its live slots, for the caller to unpin once each."""
        session = self._sessions.pop(key)
        self._count_of[session.tenant] -= 1
        self._entries[session.tenant] -= len(session.slots)
        live = self._live(session)
        self.count[live] -= 1
        self._refund(live[self.count[live] == 0])
        return live

    def _refund(self, slots: np.ndarray) -> None:
        if slots.size:
            self._bytes -= np.bincount(self._owner[slots], weights=self._charged[slots],
                                       minlength=len(self._bytes)).astype(np.int64)
            self._charged[slots] = 0

    def release(self, tenant: str, name: str) -> np.ndarray | None:
        """End a session now; its live slots, or None if the tenant holds no such one."""
        key = (tenant, name)
        return self._end(key) if key in self._sessions else None

    def expired(self, now: float) -> list[np.ndarray]:
        """End every session past its expiry; the live slots of each."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            expires_at, _, key = heapq.heappop(self._heap)
            session = self._sessions.get(key)
            if session is not None and session.expires_at == expires_at:
                out.append(self._end(key))
        return out

    def take_all(self) -> list[np.ndarray]:
        """End every session (an admin's --force); the live slots of each."""
        out = [self._end(key) for key in list(self._sessions)]
        self._heap = []
        return out

    def forget(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """These slots' pages leave DRAM (deleted, invalidated, cleared): every session
        lets go of them. Returns (the distinct slots that were retained, how many
        sessions retained each), for the caller to unpin so often."""
        slots = np.unique(slots[slots < len(self.count)])
        held = slots[self.count[slots] > 0]
        counts = self.count[held].copy()
        self._refund(held)
        self.count[held] = 0
        self._gen[held] += 1
        if held.size:
            self._forgets += 1
        return held, counts
