"""Far-tier key names: scoped by namespace and layout, grouped into a bounded number of
slots per layout so a big lookup is a few commands per shard."""

from __future__ import annotations

import os
import re

from kvstore_server.far.keys import BUCKETS, group_by_bucket, namespace_pattern, page_key

LAYOUT = bytes(range(16))


def _tag(name: bytes) -> bytes:
    return re.search(rb"\{([^}]*)\}", name).group(1)


def test_name_carries_namespace_layout_and_key():
    name = page_key("fleet", LAYOUT, b"\xab\xcd")
    assert name.startswith(b"fleet:{" + LAYOUT.hex().encode() + b".")
    assert name.endswith(b"}abcd")


def test_layouts_and_namespaces_never_share_a_name():
    key = os.urandom(16)
    names = {page_key(ns, lid, key) for ns in ("a", "b") for lid in (LAYOUT, bytes(16))}
    assert len(names) == 4


def test_4096_keys_fall_in_at_most_BUCKETS_hash_tags():
    keys = [os.urandom(16) for _ in range(4096)]
    groups = group_by_bucket("kvstore", LAYOUT, keys)
    assert len(groups) == BUCKETS
    for members in groups.values():
        assert len({_tag(name) for _, name in members}) == 1
    assert sorted(i for members in groups.values() for i, _ in members) == list(range(4096))
    # spread: no bucket holds more than twice its share
    assert max(len(m) for m in groups.values()) < 2 * 4096 / BUCKETS


def test_scan_pattern_matches_only_its_namespace():
    name = page_key("fleet", LAYOUT, b"k")
    assert name.startswith(namespace_pattern("fleet").rstrip(b"*"))
    assert not name.startswith(namespace_pattern("fleet2").rstrip(b"*"))
    assert name.startswith(namespace_pattern("fleet", LAYOUT).rstrip(b"*"))


def test_grouped_names_are_the_names_pages_are_stored_under():
    keys = [os.urandom(n) for n in (1, 7, 16, 64) for _ in range(50)]
    groups = group_by_bucket("kvstore", LAYOUT, keys)
    for members in groups.values():
        for i, name in members:
            assert name == page_key("kvstore", LAYOUT, keys[i])
