"""Keys on the wire: N keys of one size, packed back to back in one bytes object."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_KEY_BYTES", "KeyError_", "MalformedKeys", "Packed", "pack_keys", "unpack_keys"]

MAX_KEY_BYTES = 64


class MalformedKeys(ValueError):
    """Malformed keys (wrong sizes, empty, mixed lengths)."""


# The old name, deprecated: callers may catch it; it goes in the release after 0.1.
KeyError_ = MalformedKeys


def pack_keys(keys: Sequence[bytes] | bytes, key_size: int | None = None) -> tuple[bytes, int]:
    """(packed bytes, key size) from a list of equal-length keys, or pass packed through."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        if not key_size:
            raise MalformedKeys("packed keys need key_size")
        data = bytes(keys)
        if len(data) % key_size:
            raise MalformedKeys(f"{len(data)} bytes of packed keys is not a multiple of "
                            f"key_size {key_size}")
        _check_size(key_size)
        return data, key_size
    if not isinstance(keys, list):
        keys = list(keys)
    if not keys:
        return b"", key_size or 16
    try:
        data = b"".join(keys)
    except TypeError:
        bad = next(i for i, k in enumerate(keys) if not isinstance(k, (bytes, bytearray)))
        raise MalformedKeys(f"key {bad} is {type(keys[bad]).__name__}, not bytes") from None
    size = len(keys[0])
    # map(len) runs in C; a Python loop over 4,096 keys would cost half a millisecond.
    if len(set(map(len, keys))) != 1:
        bad = next(i for i, k in enumerate(keys) if len(k) != size)
        raise MalformedKeys(f"keys must all have one length: key 0 has {size} bytes, "
                        f"key {bad} has {len(keys[bad])}")
    _check_size(size)
    return data, size


def unpack_keys(data: bytes, key_size: int) -> list[bytes]:
    """The keys of a packed buffer; MalformedKeys with a message when malformed."""
    _check_size(key_size)
    if len(data) % key_size:
        raise MalformedKeys(f"{len(data)} bytes of packed keys is not a multiple of "
                        f"key_size {key_size}")
    if not data:
        return []
    # One vectorised split: numpy's void dtype turns each row into a bytes object
    # without a Python-level slice per key.
    return np.frombuffer(data, dtype=f"V{key_size}").tolist()


def _check_size(key_size: int) -> None:
    if not 1 <= key_size <= MAX_KEY_BYTES:
        raise MalformedKeys(f"key_size must be 1..{MAX_KEY_BYTES} bytes, got {key_size}")



class Packed:
    """Keys as they travel: n keys of `size` bytes back to back. `rows` views them as an
    (n, size) uint8 array without copying; `key(i)` cuts one out only when needed."""

    __slots__ = ("data", "n", "size")

    def __init__(self, data: bytes, size: int) -> None:
        # No keys may come with key_size 0 (an unset PackedKeys); any other size is
        # checked even with no keys, so the store never sees a size it cannot record.
        if data or size:
            _check_size(size)
        if data and len(data) % size:
            raise MalformedKeys(f"{len(data)} bytes of packed keys is not a multiple of "
                            f"key_size {size}")
        self.data = bytes(data)
        self.size = size
        self.n = len(data) // size if data else 0

    @classmethod
    def of(cls, keys) -> Packed:
        """From a Packed, or a sequence of equal-length bytes keys."""
        if isinstance(keys, Packed):
            return keys
        data, size = pack_keys(list(keys))
        return cls(data, size)

    def __len__(self) -> int:
        return self.n

    @property
    def rows(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.uint8).reshape(self.n, self.size)

    def key(self, i: int) -> bytes:
        return self.data[i * self.size:(i + 1) * self.size]

    def __iter__(self):
        return iter(self.select(range(self.n)))

    def __getitem__(self, i: int) -> bytes:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.key(i % self.n)

    def select(self, idx) -> list[bytes]:
        return [self.key(int(i)) for i in idx]
