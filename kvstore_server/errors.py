"""Outcomes a request can have; codes.py maps each to one status on each wire."""

from __future__ import annotations

import enum

from kvstore_protocol.reasons import Reason  # one definition, shared with the client

__all__ = ["ADMIN_ONLY", "Outcome", "Reason", "StoreError"]


class Outcome(enum.Enum):
    INVALID = "invalid"          # malformed keys, wrong sizes, unknown layout
    NOT_FOUND = "not_found"      # a key the caller needs is not stored
    EXHAUSTED = "exhausted"      # no slot can be freed (all leased or being written), or quota
    EXPIRED = "expired"          # the lease or reservation named is gone
    UNAUTHENTICATED = "unauthenticated"  # no credentials, or ones the server does not know
    DENIED = "denied"            # known caller, not allowed this (a tenant on Admin, ...)
    UNFINISHED = "unfinished"    # done in part (a far-tier clear a shard kept from ending)


# Outcomes only Admin calls end with: only the gRPC path serves Admin, so the fast path's
# wire has no status for these (codes.py maps every other outcome).
ADMIN_ONLY: frozenset[Outcome] = frozenset({Outcome.UNFINISHED})


class StoreError(Exception):
    """A request the store cannot serve, with a message that says what was wrong and,
    where a client must react, a reason it can branch on."""

    def __init__(self, outcome: Outcome, message: str, reason: Reason | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.reason = reason
