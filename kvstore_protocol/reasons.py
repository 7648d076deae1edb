"""Why a call failed, in a form code branches on: the same on the gRPC path (trailing
metadata) and the fast path (a frame's flags, fastwire.REASON_FLAGS)."""

from __future__ import annotations

import enum

__all__ = ["REASON_KEY", "Reason"]

# The trailing metadata key under which the server names a Reason.
REASON_KEY = "kvstore-reason"


class Reason(enum.Enum):
    """Why a call failed, where the caller must react and not only report it: the server
    sends it beside the status; code branches on it, never on the message, which is
    for people and may be reworded."""

    LAYOUT_UNKNOWN = "layout-unknown"      # not registered (the server restarted): register again
    SHM_TOKEN_STALE = "shm-token-stale"    # the region changed (restart): attach again
    PAGES_MISSING = "pages-missing"        # a key asked for is stored nowhere
