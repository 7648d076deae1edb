"""Tests for connector.scheduler.hashing: chained xxh3 page keys."""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore_connector.scheduler.hashing import KEY_BYTES, page_keys
from kvstore_protocol.layout import PageLayout

REPO = pathlib.Path(__file__).resolve().parents[2]
SEED = bytes(range(16))
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def reference_keys(tokens, page_tokens, seed, extras=None):
    """The scheme written out the obvious way: struct-packed ids, one hasher per page."""
    key, keys = seed, []
    for p in range(len(tokens) // page_tokens):
        h = xxhash.xxh3_128()
        h.update(key)
        h.update(struct.pack(f"<{page_tokens}i", *tokens[p * page_tokens:(p + 1) * page_tokens]))
        if extras is not None and extras[p] is not None:
            h.update(extras[p])
        key = h.digest()
        keys.append(key)
    return keys


def random_tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(I32_MIN, I32_MAX, n, dtype=np.int64, endpoint=True).astype(np.int32)
    ids[:3] = (0, I32_MIN, I32_MAX)[:n]  # the edges, and a page that starts with zero bytes
    return ids


@pytest.mark.parametrize("page_tokens", [1, 3, 16, 256])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000])
def test_matches_reference(n, page_tokens):
    ids = random_tokens(n, seed=n)
    keys = page_keys(ids, page_tokens, SEED)
    assert keys == reference_keys(ids.tolist(), page_tokens, SEED)
    assert len(keys) == n // page_tokens
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)


def test_zero_bytes_are_kept():
    # Small ids end in zero bytes; a page of them must not be trimmed anywhere.
    for ids in (np.zeros(64, np.int32), np.arange(64, dtype=np.int32)):
        assert page_keys(ids, 16, SEED) == reference_keys(ids.tolist(), 16, SEED)
    extras = [b"\0", b"a\0\0", None, bytes(8)]
    assert page_keys(np.zeros(64, np.int32), 16, SEED, extra=extras) == reference_keys(
        [0] * 64, 16, SEED, extras)
    assert page_keys(np.zeros(64, np.int32), 16, SEED, extra=b"\0\0") == reference_keys(
        [0] * 64, 16, SEED, [b"\0\0"] * 4)


def test_frozen_vector():
    # Stored pages are named by these keys: if this changes, every store is invalidated.
    tokens = [0, 1, -1, I32_MAX, I32_MIN, 151643, 7, 42]
    keys = page_keys(tokens, 4, SEED, extra=[None, b"lora:7"])
    assert [k.hex() for k in keys] == ["ef813996aca455c7fe32c09d96ce505b",
                                       "26f6ce5292f3c2a394668687cf5a6092"]


def test_extra_matches_reference():
    ids = random_tokens(64)
    extras = [None, b"img:" + bytes(16), b"", b"x" * 100]
    assert page_keys(ids, 16, SEED, extra=extras) == reference_keys(ids.tolist(), 16, SEED,
                                                                     extras)
    assert page_keys(ids, 16, SEED, extra=b"salt") == reference_keys(ids.tolist(), 16, SEED,
                                                                     [b"salt"] * 4)


def test_partial_page_has_no_key():
    ids = random_tokens(40)
    assert page_keys(ids, 16, SEED) == page_keys(ids[:32], 16, SEED)
    assert page_keys(ids[:15], 16, SEED) == []
    assert page_keys([], 16, SEED) == []


def test_parent_continues_the_chain():
    ids = random_tokens(100)
    whole = page_keys(ids, 10, SEED)
    for split in (1, 4, 9):
        head = page_keys(ids[:split * 10], 10, SEED)
        tail = page_keys(ids[split * 10:], 10, SEED, parent=head[-1])
        assert head + tail == whole


def test_parent_with_per_page_extra():
    ids = random_tokens(64)
    extras = [None, b"a", None, b"b"]
    whole = page_keys(ids, 16, SEED, extra=extras)
    head = page_keys(ids[:32], 16, SEED, extra=extras[:2])
    assert head + page_keys(ids[32:], 16, SEED, extra=extras[2:], parent=head[-1]) == whole


def test_per_page_extra_changes_keys_from_its_page_onward():
    ids = random_tokens(128)
    plain = page_keys(ids, 16, SEED)
    for page in (0, 3, 7):
        extras = [None] * 8
        extras[page] = b"mm-hash"
        keyed = page_keys(ids, 16, SEED, extra=extras)
        assert keyed[:page] == plain[:page]
        assert all(a != b for a, b in zip(keyed[page:], plain[page:]))


def test_shared_extra_changes_every_key():
    ids = random_tokens(64)
    plain = page_keys(ids, 16, SEED)
    salted = page_keys(ids, 16, SEED, extra=b"tenant-salt")
    assert all(a != b for a, b in zip(salted, plain))
    assert salted == page_keys(ids, 16, SEED, extra=[b"tenant-salt"] * 4)


def test_empty_extras_fold_as_nothing():
    ids = random_tokens(64)
    plain = page_keys(ids, 16, SEED)
    assert page_keys(ids, 16, SEED, extra=b"") == plain
    assert page_keys(ids, 16, SEED, extra=[None, b"", None, None]) == plain
    assert page_keys(ids, 16, SEED, extra=(None,) * 4) == plain


def test_seed_and_prefix_matter():
    ids = random_tokens(64)
    assert set(page_keys(ids, 16, SEED)).isdisjoint(page_keys(ids, 16, bytes(16)))
    # The same page behind a different first page gets a different key.
    other = ids.copy()
    other[0] += 1
    a, b = page_keys(ids, 16, SEED), page_keys(other, 16, SEED)
    assert all(x != y for x, y in zip(a, b))
    # A repeated page gets a fresh key each time: keys name prefixes, not pages.
    assert len(set(page_keys(np.zeros(160, np.int32), 16, SEED))) == 10


@pytest.mark.parametrize("convert", [
    lambda a: a.tolist(),
    lambda a: tuple(a.tolist()),
    lambda a: a.astype(np.int64),
    lambda a: a.astype(">i4"),
    lambda a: np.repeat(a, 2)[::2],  # not contiguous
])
def test_input_forms_agree(convert):
    ids = random_tokens(80)
    assert page_keys(convert(ids), 16, SEED) == page_keys(ids, 16, SEED)


def test_small_unsigned_ids():
    ids = np.arange(64, dtype=np.uint16)
    assert page_keys(ids, 16, SEED) == page_keys(ids.astype(np.int32), 16, SEED)


def test_int32_array_is_used_in_place():
    from kvstore_connector.scheduler.hashing import _as_int32_le
    ids = random_tokens(1024)
    assert np.shares_memory(_as_int32_le(ids), ids)


def test_chain_seed_from_layout():
    layout = PageLayout(model="m", num_layers=2, page_tokens=16, num_kv_heads=2, head_size=64)
    ids = random_tokens(64)
    assert page_keys(ids, 16, layout.chain_seed) == reference_keys(ids.tolist(), 16,
                                                                   layout.chain_seed)


def test_keys_do_not_depend_on_hash_seed_or_process():
    layout = PageLayout(model="m", num_layers=2, page_tokens=16, num_kv_heads=2, head_size=64)
    ids = random_tokens(200)
    script = (
        "import sys; from kvstore_connector.scheduler.hashing import page_keys;"
        "from kvstore_protocol.layout import PageLayout;"
        "seed = PageLayout(model='m', num_layers=2, page_tokens=16, num_kv_heads=2,"
        " head_size=64).chain_seed;"
        "ids = [int(t) for t in sys.argv[1].split(',')];"
        "print(' '.join(k.hex() for k in page_keys(ids, 16, seed, extra=b'lora')))"
    )
    expected = " ".join(k.hex() for k in page_keys(ids, 16, layout.chain_seed, extra=b"lora"))
    for hash_seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed,
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-c", script, ",".join(map(str, ids.tolist()))],
                             env=env, cwd=REPO, capture_output=True, text=True, check=True)
        assert out.stdout.split() == expected.split()


@pytest.mark.parametrize("tokens", [
    np.array([I32_MAX + 1] * 16, dtype=np.int64),
    np.array([I32_MIN - 1] + [0] * 15, dtype=np.int64),
    np.array([2**32 - 1] * 16, dtype=np.uint32),
    [0] * 15 + [2**40],
    [0] * 15 + [2**70],  # beyond int64: numpy makes an object array
])
def test_out_of_range_ids_raise(tokens):
    with pytest.raises(ValueError, match="int32"):
        page_keys(tokens, 16, SEED)


@pytest.mark.parametrize("tokens, error", [
    (np.zeros(16, dtype=np.float32), TypeError),
    ([0.5] * 16, TypeError),
    (np.zeros(16, dtype=bool), TypeError),
    (["a"] * 16, TypeError),
    (np.zeros((2, 16), dtype=np.int32), ValueError),
    (np.int32(3), ValueError),
])
def test_bad_tokens_raise(tokens, error):
    with pytest.raises(error):
        page_keys(tokens, 16, SEED)


@pytest.mark.parametrize("page_tokens, error", [
    (0, ValueError), (-16, ValueError), (True, TypeError), (1.5, TypeError), ("16", TypeError),
    (None, TypeError),
])
def test_bad_page_tokens_raise(page_tokens, error):
    with pytest.raises(error, match="page_tokens"):
        page_keys(range(32), page_tokens, SEED)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(seed=bytes(15)), ValueError, "seed must be 16 bytes"),
    (dict(seed=bytes(17)), ValueError, "seed must be 16 bytes"),
    (dict(seed="0" * 16), TypeError, "seed must be bytes"),
    (dict(seed=bytearray(16)), TypeError, "seed must be bytes"),
    (dict(parent=bytes(8)), ValueError, "parent must be 16 bytes"),
    (dict(parent=0), TypeError, "parent must be bytes"),
    (dict(extra=[b"a"]), ValueError, "1 entries but tokens hold 2 full pages"),
    (dict(extra=[b"a"] * 3), ValueError, "3 entries but tokens hold 2 full pages"),
    (dict(extra="salt"), TypeError, "extra must be"),
    (dict(extra=bytearray(b"salt")), TypeError, "extra must be"),
    (dict(extra=7), TypeError, "extra must be"),
    (dict(extra=[b"a", 7]), TypeError, r"extra\[1\] must be bytes or None"),
    (dict(extra=[b"a", "b"]), TypeError, r"extra\[1\] must be bytes or None"),
])
def test_bad_arguments_raise(kwargs, error, match):
    args = dict(seed=SEED) | kwargs
    seed = args.pop("seed")
    with pytest.raises(error, match=match):
        page_keys(np.arange(40, dtype=np.int32), 16, seed, **args)
