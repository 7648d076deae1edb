"""Names of pages in the far tier: one Redis key per page, grouped per slot by a hash tag.

    <namespace>:{<layout_id hex>.<bucket hex>}<page key hex>
    e.g. kvstore:{00112233445566778899aabbccddeeff.2a}9f1c...e0

- The namespace is the fleet's (`--far-namespace`): servers that share it share pages,
  and an admin `clear` of one deployment scans only its own prefix.
- The layout id is the store's, already scoped to the tenant (kvstore_server.tenants):
  two tenants, models, dtypes or TP ranks never name the same key.
- The hash tag `{layout.bucket}` decides the slot. Without a tag every page would land on
  its own slot and a lookup of 4,096 keys would be 4,096 commands; with one tag per
  layout every page of a layout would sit on one shard (one hot master, one master's
  memory). In between: each key falls in one of BUCKETS buckets by a hash of its bytes,
  one tag per bucket. A lookup groups its keys per bucket and sends one command per
  bucket (a multi-key command needs all keys in one slot); the cluster client pipelines
  every command bound for one master into one write, so a 4,096-key lookup costs one
  round trip per shard (two if a failover moved a slot: MOVED, then the new owner) and
  at most BUCKETS commands, ~BUCKETS/shards per master. 64 buckets spread one layout
  over 64 slots, which a 3-master cluster splits about evenly (±20% per master) while
  keeping per-call work on the client small (~64 commands, not 4,096).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import xxhash

__all__ = ["BUCKETS", "SLOTS", "bucket_of", "group_by_bucket", "is_record", "layout_of_name",
           "namespace_pattern", "page_key", "record_key", "record_pattern", "slot_of"]

BUCKETS = 64

SLOTS = 16384       # hash slots of a Redis/Valkey Cluster


def bucket_of(key: bytes) -> int:
    # A hash of the key, not its leading bytes: keys are opaque (1-64 bytes, chosen by
    # the client) and need not be uniform.
    return xxhash.xxh3_64_intdigest(key) % BUCKETS


def page_key(namespace: str, layout_id: bytes, key: bytes, bucket: int | None = None) -> bytes:
    """The Redis key of one page (bucket: bucket_of(key), when the caller has it)."""
    bucket = bucket_of(key) if bucket is None else bucket
    return f"{namespace}:{{{layout_id.hex()}.{bucket:02x}}}{key.hex()}".encode()


def group_by_bucket(namespace: str, layout_id: bytes,
                    keys: list[bytes]) -> dict[int, list[tuple[int, bytes]]]:
    """bucket -> [(index in keys, Redis key)]: the keys each per-slot command names.
    (Written for speed: calling page_key per key was several times slower.)"""
    lid = layout_id.hex()
    prefixes = [f"{namespace}:{{{lid}.{b:02x}}}".encode() for b in range(BUCKETS)]
    groups: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
    digest = xxhash.xxh3_64_intdigest
    for i, key in enumerate(keys):
        bucket = digest(key) % BUCKETS
        groups[bucket].append((i, prefixes[bucket] + key.hex().encode()))
    return groups


def namespace_pattern(namespace: str, layout_id: bytes | None = None) -> bytes:
    """A SCAN MATCH pattern for every page of the namespace, or of one layout in it."""
    return (f"{namespace}:{{{layout_id.hex()}.*" if layout_id else f"{namespace}:*").encode()


def record_key(namespace: str, layout_id: bytes) -> bytes:
    """The name of a layout's record (records.py), in its first bucket: a page key ends
    in hex digits, so no page is ever named so."""
    return f"{namespace}:{{{layout_id.hex()}.00}}layout".encode()


def is_record(name: bytes) -> bool:
    """Whether a far key names a layout record, not a page."""
    return name.endswith(b"}layout")


def record_pattern(namespace: str) -> bytes:
    """A SCAN MATCH pattern for every layout record of the namespace."""
    return f"{namespace}:{{*.00}}layout".encode()


def layout_of_name(namespace: str, name: bytes) -> bytes | None:
    """The layout id a far key of the namespace names (page or record), or None."""
    head = len(namespace) + 2                   # "<namespace>:{"
    if name[head - 2:head] != b":{" or name[head + 32:head + 33] != b".":
        return None
    try:
        return bytes.fromhex(name[head:head + 32].decode())
    except ValueError:
        return None


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
        table.append(crc)
    return table


_CRC16 = _crc16_table()


@functools.lru_cache(maxsize=1 << 14)
def slot_of(name: bytes) -> int:
    """The cluster's hash slot of a Redis key: CRC16 (XMODEM) of its hash tag (the
    bytes between the first `{` and the next `}`, when not empty), else of the whole
    name, mod 16384, as the cluster specification defines it. The far client routes
    each command to its slot's master by it (shards.py). Cached: a layout's pages share
    64 tags, and a key's page name differs per page, so callers pass the tag part."""
    start = name.find(b"{")
    if start >= 0:
        end = name.find(b"}", start + 1)
        if end > start + 1:
            name = name[start + 1:end]
    crc = 0
    for byte in name:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[(crc >> 8) ^ byte]
    return crc % SLOTS
