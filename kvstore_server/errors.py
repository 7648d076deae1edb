"""Outcomes a request can have; the RPC layer maps each to one gRPC status."""

from __future__ import annotations

import enum

__all__ = ["Outcome", "Reason", "StoreError"]


class Outcome(enum.Enum):
    INVALID = "invalid"          # malformed keys, wrong sizes, unknown layout
    NOT_FOUND = "not_found"      # a key the caller needs is not stored
    EXHAUSTED = "exhausted"      # no slot can be freed (all leased or being written), or quota
    EXPIRED = "expired"          # the lease or reservation named is gone
    UNAUTHENTICATED = "unauthenticated"  # no credentials, or ones the server does not know
    DENIED = "denied"            # known caller, not allowed this (a tenant on Admin, ...)


class Reason(enum.Enum):
    """Why a request failed, where a client must react to it and not only report it. The
    server sends it beside the status (status.py); clients branch on it, never on the
    message, which is for people and may be reworded."""

    LAYOUT_UNKNOWN = "layout-unknown"      # not registered (the server restarted): register again
    SHM_TOKEN_STALE = "shm-token-stale"    # the region changed (restart): attach again
    PAGES_MISSING = "pages-missing"        # a key asked for is stored nowhere


class StoreError(Exception):
    """A request the store cannot serve, with a message that says what was wrong and,
    where a client must react, a reason it can branch on."""

    def __init__(self, outcome: Outcome, message: str, reason: Reason | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.reason = reason
