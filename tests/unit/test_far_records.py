"""Layout records in the far tier: their names, their encoding, and which layouts a scope
of an invalidation matches."""

from __future__ import annotations

import fnmatch

from kvstore_client import PageLayout
from kvstore_server.far.keys import (
    layout_of_name,
    namespace_pattern,
    page_key,
    record_key,
    record_pattern,
)
from kvstore_server.far.records import LayoutRecord, Scope

LAYOUT = PageLayout(model="m", num_layers=2, page_tokens=16, num_kv_heads=2, head_size=64,
                    salt="rev-7")
LID = bytes(range(16))


def test_a_record_sits_in_its_layouts_first_bucket_and_no_page_is_named_so():
    name = record_key("ns", LID)
    assert name == page_key("ns", LID, b"", 0).replace(b"}", b"}layout")
    assert fnmatch.fnmatchcase(name.decode(), record_pattern("ns").decode())
    # a clear of the layout (its pattern) removes its record too
    assert fnmatch.fnmatchcase(name.decode(), namespace_pattern("ns", LID).decode())
    for key in (b"\x00", b"layout", bytes(range(64))):       # page names end in hex
        page = page_key("ns", LID, key).decode()
        assert not fnmatch.fnmatchcase(page, record_pattern("ns").decode())


def test_the_layout_of_a_name_is_read_back_and_foreign_names_are_none():
    assert layout_of_name("ns", record_key("ns", LID)) == LID
    assert layout_of_name("ns", page_key("ns", LID, b"\xab")) == LID
    assert layout_of_name("ns", b"ns:{zz" + b"0" * 30 + b".00}ab") is None
    assert layout_of_name("ns", b"other") is None


def test_a_record_round_trips_and_garbage_decodes_to_none():
    record = LayoutRecord.of(LID, "team-a", LAYOUT)
    assert record.revision == "rev-7"
    assert LayoutRecord.decode(record.encode()) == record
    for bad in (b"", b"{", b"[]", b'{"layout_id": "00"}', b"\xff" * 8,
                b'{"layout_id": "0011", "tenant": "", "model": "", "revision": ""}'):
        assert LayoutRecord.decode(bad) is None


def test_a_scope_matches_every_field_it_names():
    record = LayoutRecord(LID, "team-a", "m", "rev-7")
    assert Scope(model="m").matches(record)
    assert Scope(model="m", revision="rev-7").matches(record)
    assert not Scope(model="m", revision="rev-8").matches(record)
    assert not Scope(model="n").matches(record)
    assert Scope(layout_id=LID).matches(record)
    assert not Scope(layout_id=bytes(16)).matches(record)
    assert Scope(tenant="team-a", model="m").matches(record)
    assert not Scope(tenant="team-b", model="m").matches(record)


def test_a_scope_without_a_target_or_with_a_bare_revision_is_refused():
    assert Scope().problems()
    assert Scope(revision="r").problems()
    assert Scope(layout_id=b"\x00").problems()
    assert not Scope(tenant="t").problems()
