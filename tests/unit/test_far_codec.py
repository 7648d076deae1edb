"""The far tier's value codec: a page comes back byte-exact, anything else is a miss
with its reason (a value not signed by a key of the keyring included), and no bytes from
the cluster can make decode raise."""

from __future__ import annotations

import hmac
import os
import struct

import xxhash
from hypothesis import given, settings, strategies as st

from kvstore_server.far.codec import HEADER_BYTES, ValueVerdict, decode, encode
from kvstore_server.far.secret import INSECURE, Keyring

LAYOUT = bytes(range(16))
KEY = b"\x01" * 16


def test_round_trip_is_byte_exact():
    page = os.urandom(64 << 10)
    got = decode(encode(LAYOUT, KEY, page), LAYOUT, KEY)
    assert got.reason is ValueVerdict.OK and bytes(got.payload) == page


def test_header_is_seventy_two_bytes_then_key_then_payload():
    value = encode(LAYOUT, KEY, b"abc")
    assert HEADER_BYTES == 72 and len(value) == 72 + 16 + 3
    assert value[:4] == b"KVFP" and value[4] == 2 and value[8:24] == LAYOUT
    assert struct.unpack_from("<Q", value, 24)[0] == 3
    assert value[32:40] == INSECURE.writing.key_id and value[72:88] == KEY
    mac = INSECURE.writing.mac.copy()
    mac.update(value[:40] + KEY + b"abc")
    assert value[40:72] == mac.digest()            # HMAC-SHA256 of all but itself


A = Keyring.of([b"a" * 64])
B = Keyring.of([b"b" * 64])


def test_a_value_signed_without_the_fleets_secret_is_never_served():
    page = os.urandom(4096)
    assert bytes(decode(encode(LAYOUT, KEY, page, A), LAYOUT, KEY, A).payload) == page
    assert decode(encode(LAYOUT, KEY, page, B), LAYOUT, KEY, A).reason is ValueVerdict.UNKNOWN_KEY
    assert decode(encode(LAYOUT, KEY, page), LAYOUT, KEY, A).reason is ValueVerdict.UNKNOWN_KEY
    # an attacker who copies A's key id into a value of its own still has no MAC
    forged = bytearray(encode(LAYOUT, KEY, page, B))
    forged[32:40] = A.writing.key_id
    assert decode(bytes(forged), LAYOUT, KEY, A).reason is ValueVerdict.CORRUPT


def test_rotation_reads_every_secret_and_signs_with_the_first():
    old, new = b"o" * 64, b"n" * 64
    before, during, after = Keyring.of([old]), Keyring.of([new, old]), Keyring.of([new])
    page = b"page"
    by_old = encode(LAYOUT, KEY, page, before)
    by_new = encode(LAYOUT, KEY, page, during)
    assert by_new[32:40] == after.writing.key_id != before.writing.key_id
    assert decode(by_old, LAYOUT, KEY, during).reason is ValueVerdict.OK
    assert decode(by_new, LAYOUT, KEY, during).reason is ValueVerdict.OK
    assert decode(by_old, LAYOUT, KEY, after).reason is ValueVerdict.UNKNOWN_KEY
    assert decode(by_new, LAYOUT, KEY, after).reason is ValueVerdict.OK


def test_a_version_one_value_is_unsigned_and_refused():
    payload = b"a page from before the MAC"
    h = xxhash.xxh3_64(KEY)
    h.update(payload)
    old = struct.pack("<4sBBH16sQQ", b"KVFP", 1, len(KEY), 0, LAYOUT, len(payload),
                      h.intdigest()) + KEY + payload
    assert decode(old, LAYOUT, KEY).reason is ValueVerdict.UNSIGNED
    assert decode(old[:5], LAYOUT, KEY).reason is ValueVerdict.UNSIGNED


def test_the_key_id_and_mac_key_reveal_nothing_of_each_other():
    secret = b"s" * 64
    ring = Keyring.of([secret])
    assert ring.writing.key_id == hmac.digest(secret, b"kvstore far key id v2", "sha256")[:8]
    assert secret.hex().encode()[:16] not in ring.writing.key_id.hex().encode()


def test_missing_is_a_miss():
    assert decode(None, LAYOUT, KEY).reason is ValueVerdict.MISSING


def test_every_truncation_is_a_miss():
    value = encode(LAYOUT, KEY, os.urandom(1000))
    for cut in (0, 1, 3, 4, 20, 39, 40, 41, 71, 72, 73, 87, 88, 89, len(value) - 1):
        got = decode(value[:cut], LAYOUT, KEY)
        assert got.payload is None, cut
        assert got.reason in (ValueVerdict.TRUNCATED, ValueVerdict.FOREIGN), cut
    assert decode(value + b"x", LAYOUT, KEY).reason is ValueVerdict.TRUNCATED


def test_a_flipped_payload_bit_is_corrupt():
    value = bytearray(encode(LAYOUT, KEY, os.urandom(4096)))
    value[-100] ^= 0x10
    assert decode(bytes(value), LAYOUT, KEY).reason is ValueVerdict.CORRUPT


def test_a_flipped_mac_is_corrupt():
    value = bytearray(encode(LAYOUT, KEY, b"page"))
    value[60] ^= 1
    assert decode(bytes(value), LAYOUT, KEY).reason is ValueVerdict.CORRUPT


def test_foreign_values_are_misses():
    assert decode(b"hello world", LAYOUT, KEY).reason is ValueVerdict.FOREIGN
    assert decode(os.urandom(100_000), LAYOUT, KEY).reason is ValueVerdict.FOREIGN
    assert decode(b"", LAYOUT, KEY).reason is ValueVerdict.FOREIGN
    newer = bytearray(encode(LAYOUT, KEY, b"page"))
    newer[4] = 3                                    # a later version of the format
    assert decode(bytes(newer), LAYOUT, KEY).reason is ValueVerdict.FOREIGN
    assert decode(12345, LAYOUT, KEY).reason is ValueVerdict.FOREIGN      # not bytes at all


def test_another_layouts_or_keys_value_is_a_miss():
    value = encode(LAYOUT, KEY, b"page")
    assert decode(value, bytes(16), KEY).reason is ValueVerdict.WRONG_KEY
    assert decode(value, LAYOUT, b"\x02" * 16).reason is ValueVerdict.WRONG_KEY
    assert decode(value, LAYOUT, KEY[:8]).reason is ValueVerdict.WRONG_KEY


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 199), st.integers(0, 255))
def test_no_bytes_make_decode_raise_or_serve_a_changed_value(noise, at, xor):
    value = bytearray(encode(LAYOUT, KEY, b"the page"))
    value[at % len(value)] ^= xor or 1
    for candidate in (bytes(noise), bytes(value), bytes(value) + noise):
        got = decode(candidate, LAYOUT, KEY)
        assert (got.payload is None) == (got.reason is not ValueVerdict.OK)
        if got.payload is not None:
            assert bytes(got.payload) == b"the page"
