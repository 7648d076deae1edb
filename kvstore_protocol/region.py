"""The shared region's format: what a client that maps the server's pool reads in it.

The server creates the region (kvstore_server.region), clients map it (kvstore_client.shm).
The first 4 KiB are a header; pages start after it, and the presence map's counters
(presence_map, 4 MiB) take the region's end when the server keeps one:

    0              16             32              64         4096            end - 4 MiB
    | magic (16 B) | token (16 B) | presence (32 B) | zero ... | pool slots ... | counters |

The token is random per region. A client proves it mapped this very region (so it is on
this host and may read the file) by sending the token back with every data-plane call; a
restarted server has a new token, so a stale mapping is refused, never read.
"""

from __future__ import annotations

import xxhash

__all__ = ["HANDOUT_MAGIC", "HEADER_BYTES", "MAGIC", "TOKEN_BYTES", "TOKEN_OFFSET", "region_id"]

HEADER_BYTES = 4096
MAGIC = b"kvstore-region\x00\x01"
TOKEN_OFFSET = 16
TOKEN_BYTES = 16
# A server whose pool is a sealed memfd (--shm-group) gives out its path as a Unix socket
# that sends this, with the descriptor (kvstore_server/handout.py says why).
HANDOUT_MAGIC = b"kvstore-handout1"


def region_id(token: bytes) -> int:
    """A public name of the region whose secret token this is: what a lookup's pins
    (fastwire.PINS) say their offsets belong to. A hash, so that saying it over any
    connection gives nobody the token that proves a mapping."""
    return xxhash.xxh3_64_intdigest(b"kvstore.region.v1" + token)
