"""The fleet's secret file: the first secret signs, all verify, a change is picked up
without a restart, and a bad edit keeps the secrets in force."""

from __future__ import annotations

import os

import pytest

from kvstore_server.far.codec import ValueVerdict, decode, encode
from kvstore_server.far.secret import CHECK_INTERVAL, SecretFile

LAYOUT, KEY = bytes(16), b"k" * 16
OLD, NEW = "0" * 64, "1" * 64


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path, *lines: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)               # as an operator's tool would: a new inode


def test_a_rotation_rolls_through_without_a_restart(tmp_path):
    path, clock = tmp_path / "secret", Clock()
    write(path, OLD)
    keys = SecretFile(str(path), clock)
    by_old = encode(LAYOUT, KEY, b"page", keys)
    write(path, NEW, OLD)                               # step 2: the new one signs
    assert keys.keyring().writing.key_id == by_old[32:40]   # not looked at yet
    clock.now += CHECK_INTERVAL
    by_new = encode(LAYOUT, KEY, b"page", keys)
    assert by_new[32:40] != by_old[32:40]
    assert decode(by_old, LAYOUT, KEY, keys).reason is ValueVerdict.OK
    write(path, NEW)                                    # step 3: the old one dropped
    clock.now += CHECK_INTERVAL
    assert decode(by_old, LAYOUT, KEY, keys).reason is ValueVerdict.UNKNOWN_KEY
    assert decode(by_new, LAYOUT, KEY, keys).reason is ValueVerdict.OK


@pytest.mark.parametrize("edit", ["short", "", None])
def test_a_bad_edit_keeps_the_secrets_in_force(tmp_path, edit):
    path, clock = tmp_path / "secret", Clock()
    write(path, OLD)
    keys = SecretFile(str(path), clock)
    value = encode(LAYOUT, KEY, b"page", keys)
    if edit is None:
        path.unlink()
    else:
        write(path, edit)
    clock.now += CHECK_INTERVAL
    assert decode(value, LAYOUT, KEY, keys).reason is ValueVerdict.OK
    assert encode(LAYOUT, KEY, b"page", keys) == value
