"""The client's per-call packing and views (dataplane.packed_keys, buffers.byte_view):
their short ways for the common list and numpy buffer give what the long ways give, and
every bad input still gets the long way's error."""

import numpy as np
import pytest

from kvstore_client.buffers import byte_view
from kvstore_client.dataplane import packed_keys
from kvstore_protocol.keys import MalformedKeys, Packed


def test_a_list_of_equal_keys_packs_as_pack_keys_does():
    keys = [b"a" * 16, b"b" * 16, b"c" * 16]
    assert packed_keys(keys) == (16, b"".join(keys))
    assert packed_keys(keys[:1]) == (16, keys[0])
    assert packed_keys([bytearray(b"xy"), b"zw"]) == (2, b"xyzw")
    assert packed_keys(Packed(b"".join(keys), 16)) == (16, b"".join(keys))
    assert packed_keys(iter(keys)) == (16, b"".join(keys))      # not a list: the long way


@pytest.mark.parametrize("keys", [
    [b"a" * 16, b"b" * 15],             # two lengths
    [b"a" * 15, b"b" * 17, b"c" * 16],  # lengths that sum to a multiple of the first
    [b""],                              # empty key
    [b"k" * 65],                        # past MAX_KEY_BYTES
    ["a" * 16],                         # not bytes
    [b"a" * 16, "b" * 16],
])
def test_bad_keys_get_the_long_ways_error(keys):
    with pytest.raises(MalformedKeys):
        packed_keys(keys)


def test_a_contiguous_array_is_viewed_in_place():
    a = np.zeros((2, 8), np.float32)
    view = byte_view(a, 64, writable=True)
    assert view.nbytes == 64 and view.format == "B" and not view.readonly
    view[0] = 7
    assert a.view(np.uint8)[0, 0] == 7                 # the caller's memory, no copy


def test_bad_buffers_get_the_long_ways_error():
    a = np.zeros((4, 4), np.uint8)
    with pytest.raises(ValueError, match="C-contiguous"):
        byte_view(a[:, :2], 8)                          # strided
    with pytest.raises(ValueError, match="C-contiguous"):
        byte_view(np.asfortranarray(np.zeros((4, 3), np.uint8)), 12)
    with pytest.raises(ValueError, match="expected 15"):
        byte_view(a, 15)
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        byte_view(ro, 8, writable=True)
    assert byte_view(ro, 8).readonly
