"""Outcomes the storage engine reports; the RPC layer maps each to one gRPC status."""

from __future__ import annotations

import enum

__all__ = ["Outcome", "StoreError"]


class Outcome(enum.Enum):
    INVALID = "invalid"          # malformed keys, wrong sizes, unknown layout
    NOT_FOUND = "not_found"      # a key the caller needs is not stored
    EXHAUSTED = "exhausted"      # no slot can be freed: everything is leased or being written
    EXPIRED = "expired"          # the lease or reservation named is gone


class StoreError(Exception):
    """A request the store cannot serve, with a message that says what was wrong."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
