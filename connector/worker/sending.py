"""Saves to a store on another host: which pages cross the network.

Without the shared pool a save is copied to a pinned buffer and sent by a Put. Sending
every planned page made the server drop the ones it had: in a real engine, a cold round
of prompts sharing prefixes sent many more pages than it stored, and pages of earlier
rounds again. So each step asks once which of its pages the store holds (an Exists, on the
reserve thread beside the forward: connector.worker.reserving), and a page is sent by one
request only: not if the store holds it, nor if an earlier save still on its way (not
yet committed) or another request of the step sends it. A page skipped so is not copied
out either (offset -1). If the save that sends it is then dropped (computed over a failed
load), the page is a miss later, never a wrong one. A reserve-style put is no option
here: it writes into the pool this host cannot map.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..meta import SaveSpec

__all__ = ["Held", "to_send"]


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """A step's Exists: which of its keys the store holds (in the step's order), and the
    keys of earlier saves still on their way when it was asked."""

    stored: Sequence[bool]
    sending: frozenset[bytes]


def to_send(specs: Sequence[SaveSpec], held: Held) -> list[tuple[SaveSpec, list[int]]]:
    """Each request with pages to send, and the rows of its keys to send: each page once."""
    out, at, taken = [], 0, set(held.sending)
    for spec in specs:
        rows = []
        for i, key in enumerate(spec.keys):
            if not held.stored[at + i] and key not in taken:
                rows.append(i)
                taken.add(key)
        at += len(spec.keys)
        if rows:
            out.append((spec, rows))
    return out
