"""Which master serves which hash slot: the far client's own routing table.

Why the far client routes by itself instead of handing glide's cluster client one batch
for every shard. glide answers a non-atomic batch only when every command in it has an
answer, so one master that hangs (SIGSTOP, a partition that drops packets without a
reset) made every call time out whole: no far page served by any server, every breaker
open, while two masters of three were healthy. Worse, glide keeps sending a hung
master's slots to it after the cluster has promoted its replica (it learns a new owner
from a MOVED reply or a dropped connection, and a hung node gives neither): with one
master of three SIGSTOPped, a GET of its slots through glide's cluster client failed for
as long as the master hung, although the replica had taken over within seconds and a
CLUSTER SLOTS asked of a healthy node named the new master.

So the client keeps this map (from CLUSTER SLOTS, asked again when a shard fails or
answers MOVED), sends each master's commands as one batch of their own on a connection
of their own (a standalone glide client per master), all masters' batches at once, each
with the call's deadline, and keeps one breaker per master (client.py). A hung master
then costs the pages of its slots only, and its slots come back as soon as a refreshed
map names the promoted replica (docs/perf/far-failover-f9354575e2.json: every page a
hit again 2.3 s after a master is killed under load).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .keys import SLOTS, slot_of

__all__ = ["Address", "SlotMap", "command_slot", "parse_slots"]

Address = tuple[str, int]       # (host, port) of a node, as the cluster announces it

# Commands whose keys follow a script (or function) and a key count, as str and bytes.
_SCRIPTED = frozenset(v for verb in ("EVAL", "EVAL_RO", "EVALSHA", "EVALSHA_RO", "FCALL",
                                     "FCALL_RO") for v in (verb, verb.encode()))


@dataclass(frozen=True, slots=True)
class SlotMap:
    """Slot ranges and their masters, sorted by first slot."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    owners: tuple[Address, ...]

    def owner(self, slot: int) -> Address | None:
        i = bisect.bisect_right(self.starts, slot) - 1
        if i >= 0 and slot <= self.ends[i]:
            return self.owners[i]
        return None

    def masters(self) -> list[Address]:
        return list(dict.fromkeys(self.owners))


def parse_slots(reply, asked: Address) -> SlotMap:
    """A CLUSTER SLOTS reply as a SlotMap. A master announced without a host (empty or
    "?": the node does not know its own address) is reached where it was asked."""
    ranges = []
    for entry in reply or ():
        start, end, master = int(entry[0]), int(entry[1]), entry[2]
        host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
        if host in ("", "?"):
            host = asked[0]
        if 0 <= start <= end < SLOTS:
            ranges.append((start, end, (host, int(master[1]))))
    ranges.sort()
    return SlotMap(tuple(r[0] for r in ranges), tuple(r[1] for r in ranges),
                   tuple(r[2] for r in ranges))


def command_slot(command: list) -> int:
    """The hash slot of a command's keys (every far command names keys of one slot):
    its first key's. Page names are `<ns>:{<tag>}<key hex>`: the slot is the tag's, so
    only the part up to the tag is hashed (and cached, keys.py). Written for speed: a
    call routes up to 64 commands (a form that upper-cased the verb first was slower)."""
    name = command[3] if command[0] in _SCRIPTED else command[1]
    if not isinstance(name, bytes):
        name = str(name).encode()
    end = name.find(b"}")
    return slot_of(name[:end + 1] if end > 0 else name)
