"""Page keys: chained 128-bit xxh3 digests of a prompt's token ids, one per full page."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["KEY_BYTES", "page_keys"]

# Length of every key this module makes, and of the seed and parent it accepts.
KEY_BYTES = 16

# What may be folded into pages: one bytes for every page, or one bytes (or None) per page.
Extra = bytes | Sequence[bytes | None] | None

# The scheme, and why
# -------------------
#
#     key_0 = xxh3_128(seed     ‖ tokens_0 ‖ extra_0)      seed = layout.chain_seed
#     key_i = xxh3_128(key_i-1  ‖ tokens_i ‖ extra_i)      (or parent instead of seed)
#
# Chained: a page's KV depends on every token before it, so equal tokens behind a
# different prefix must get a different key. Folding the previous key in makes each key
# name its whole prefix, so "how much of this prompt is stored" is "how many leading keys
# are present", and a request that extends another continues from its last key (`parent`)
# without rehashing. vLLM's block hashes and SGLang HiCache's page hashes chain the same way.
#
# Tokens as little-endian int32: every vocabulary fits (the largest are ~256k ids), it
# hashes half the bytes of int64, and a fixed width and byte order give the same key on
# every host and engine, whatever dtype the engine holds its ids in. Nothing depends on
# Python's hash(), so PYTHONHASHSEED and the process do not matter, and xxh3's digest is
# canonical (big-endian) bytes on every host.
#
# The key and the tokens have fixed widths (16 and 4*page_tokens bytes), so the one
# variable-length part, the extra at the end, needs no length prefix to be unambiguous;
# None and b"" fold in the same way. xxh3 resists accidents (128 bits), not adversaries:
# layouts belong to a tenant, so a crafted collision can only reach that tenant's pages.
#
# The loop: the chain is sequential, so each page costs one Python-level step; the work is
# to make that step small. The token bytes are cut into per-page `bytes` in C by viewing
# the int32 array as one opaque numpy void ("V64") per page and calling tolist(); the loop
# is then a comprehension that does one concatenation and one digest per page. Of the
# loops tried (bytes or memoryview slices, an xxh3 object updated per page, one buffer with
# the key written in, itertools.accumulate, a for loop with a prebound append) this was
# the fastest, about twice the floor of bare digest calls; `kvstore-bench hash` measures
# the shipped version (docs/perf/hash-cb7f3fed21.json: 2048 keys in about 0.12 ms).
#
# A bytes extra shared by every page is appended to each page's row in numpy before the
# cut, so that path keeps one concatenation per page; per-page extras add a second one.


def page_keys(tokens, page_tokens: int, seed: bytes, *, extra: Extra = None,
              parent: bytes | None = None) -> list[bytes]:
    """The 16-byte keys of the full pages of `tokens`, in order; a trailing partial page
    has no key.

    tokens: token ids, anything np.asarray makes integers of; a contiguous int32 array is
        used in place. Ids must fit in int32.
    page_tokens: tokens per page (the layout's `page_tokens`), >= 1.
    seed: the 16-byte start of the chain (the layout's `chain_seed`). Ignored when
        `parent` is given, since the parent already descends from it.
    extra: None; one bytes object folded into every page (e.g. a LoRA name or cache
        salt); or a sequence of one bytes or None per full page (e.g. the hashes of
        images whose placeholders lie on that page). A page's extra changes its key and
        every later key.
    parent: the key of the page just before `tokens`, to continue a chain:
        ``page_keys(a + b, ...) == page_keys(a, ...) + page_keys(b, ..., parent=<last key
        of a>)`` when `a` is a whole number of pages.
    """
    _check_key("seed", seed)
    if parent is not None:
        _check_key("parent", parent)
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, (int, np.integer)):
        raise TypeError(f"page_tokens must be an integer, got {type(page_tokens).__name__}")
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    ids = _as_int32_le(tokens)
    pages = ids.size // int(page_tokens)
    shared, per_page = _split_extra(extra, pages)
    chunks = _page_chunks(ids[: pages * int(page_tokens)], pages, shared)

    digest = xxhash.xxh3_128_digest
    key = seed if parent is None else parent
    if per_page is None:
        return [key := digest(key + chunk) for chunk in chunks]
    return [key := digest(key + chunk + e) for chunk, e in zip(chunks, per_page, strict=True)]


def _check_key(name: str, value: object) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) != KEY_BYTES:
        raise ValueError(f"{name} must be {KEY_BYTES} bytes, got {len(value)}")


_INT32 = np.iinfo(np.int32)


def _as_int32_le(tokens) -> np.ndarray:
    """`tokens` as a contiguous one-dimensional little-endian int32 array."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.dtype("<i4"):
        return np.ascontiguousarray(arr)  # no copy when already contiguous
    if arr.size == 0:
        return np.empty(0, dtype="<i4")  # np.asarray([]) is float64
    if arr.dtype.kind == "O":  # Python ints beyond int64, or not integers at all
        try:
            arr = arr.astype(np.int64)
        except (OverflowError, TypeError, ValueError):
            raise ValueError("tokens must be integers in int32 range") from None
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if not np.can_cast(arr.dtype, np.int32):
        low, high = int(arr.min()), int(arr.max())
        if low < _INT32.min or high > _INT32.max:
            raise ValueError(f"token ids must fit in int32, got values in [{low}, {high}]")
    return arr.astype("<i4")


def _split_extra(extra: Extra, pages: int) -> tuple[bytes, list[bytes] | None]:
    """(bytes folded into every page, per-page bytes or None when there are none)."""
    if extra is None:
        return b"", None
    if isinstance(extra, bytes):
        return extra, None
    if isinstance(extra, (str, bytearray, memoryview)) or not isinstance(extra, Sequence):
        raise TypeError("extra must be None, bytes, or a sequence of bytes or None per page, "
                        f"got {type(extra).__name__}")
    if len(extra) != pages:
        raise ValueError(f"extra has {len(extra)} entries but tokens hold {pages} full pages")
    per_page = []
    for i, e in enumerate(extra):
        if e is None:
            e = b""
        elif not isinstance(e, bytes):
            raise TypeError(f"extra[{i}] must be bytes or None, got {type(e).__name__}")
        per_page.append(e)
    return b"", per_page if any(per_page) else None


def _page_chunks(ids: np.ndarray, pages: int, shared: bytes) -> list[bytes]:
    """One bytes per page: its token bytes, then `shared`; cut in C (see above)."""
    if pages == 0:
        return []
    rows = ids.view(np.uint8).reshape(pages, -1)
    if shared:
        width = rows.shape[1]
        joined = np.empty((pages, width + len(shared)), dtype=np.uint8)
        joined[:, :width] = rows
        joined[:, width:] = np.frombuffer(shared, dtype=np.uint8)
        rows = joined
    return rows.view(f"V{rows.shape[1]}").ravel().tolist()
