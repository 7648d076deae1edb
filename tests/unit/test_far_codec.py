"""The far tier's value codec: a page comes back byte-exact, anything else is a miss
with its reason, and no bytes from the cluster can make decode raise."""

from __future__ import annotations

import os
import struct

from hypothesis import given, settings, strategies as st

from kvstore_server.far.codec import HEADER_BYTES, Reason, decode, encode

LAYOUT = bytes(range(16))
KEY = b"\x01" * 16


def test_round_trip_is_byte_exact():
    page = os.urandom(64 << 10)
    got = decode(encode(LAYOUT, KEY, page), LAYOUT, KEY)
    assert got.reason is Reason.OK and bytes(got.payload) == page


def test_header_is_forty_bytes_then_key_then_payload():
    value = encode(LAYOUT, KEY, b"abc")
    assert HEADER_BYTES == 40 and len(value) == 40 + 16 + 3
    assert value[:4] == b"KVFP" and value[8:24] == LAYOUT and value[40:56] == KEY
    assert struct.unpack_from("<Q", value, 24)[0] == 3


def test_missing_is_a_miss():
    assert decode(None, LAYOUT, KEY).reason is Reason.MISSING


def test_every_truncation_is_a_miss():
    value = encode(LAYOUT, KEY, os.urandom(1000))
    for cut in (0, 1, 3, 4, 20, 39, 40, 41, 55, 56, 57, len(value) - 1):
        got = decode(value[:cut], LAYOUT, KEY)
        assert got.payload is None and got.reason in (Reason.TRUNCATED, Reason.FOREIGN), cut
    assert decode(value + b"x", LAYOUT, KEY).reason is Reason.TRUNCATED


def test_a_flipped_payload_bit_is_corrupt():
    value = bytearray(encode(LAYOUT, KEY, os.urandom(4096)))
    value[-100] ^= 0x10
    assert decode(bytes(value), LAYOUT, KEY).reason is Reason.CORRUPT


def test_a_flipped_checksum_is_corrupt():
    value = bytearray(encode(LAYOUT, KEY, b"page"))
    value[35] ^= 1
    assert decode(bytes(value), LAYOUT, KEY).reason is Reason.CORRUPT


def test_foreign_values_are_misses():
    assert decode(b"hello world", LAYOUT, KEY).reason is Reason.FOREIGN
    assert decode(os.urandom(100_000), LAYOUT, KEY).reason is Reason.FOREIGN
    assert decode(b"", LAYOUT, KEY).reason is Reason.FOREIGN
    newer = bytearray(encode(LAYOUT, KEY, b"page"))
    newer[4] = 2                                    # a later version of the format
    assert decode(bytes(newer), LAYOUT, KEY).reason is Reason.FOREIGN
    assert decode(12345, LAYOUT, KEY).reason is Reason.FOREIGN      # not bytes at all


def test_another_layouts_or_keys_value_is_a_miss():
    value = encode(LAYOUT, KEY, b"page")
    assert decode(value, bytes(16), KEY).reason is Reason.WRONG_KEY
    assert decode(value, LAYOUT, b"\x02" * 16).reason is Reason.WRONG_KEY
    assert decode(value, LAYOUT, KEY[:8]).reason is Reason.WRONG_KEY


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 199), st.integers(0, 255))
def test_no_bytes_make_decode_raise_or_serve_a_changed_value(noise, at, xor):
    value = bytearray(encode(LAYOUT, KEY, b"the page"))
    value[at % len(value)] ^= xor or 1
    for candidate in (bytes(noise), bytes(value), bytes(value) + noise):
        got = decode(candidate, LAYOUT, KEY)
        assert (got.payload is None) == (got.reason is not Reason.OK)
        if got.payload is not None:
            assert bytes(got.payload) == b"the page"
