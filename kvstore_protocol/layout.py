"""Page layouts: what makes KV pages interchangeable, and their identity hash."""

from __future__ import annotations

import dataclasses
import struct

import xxhash

__all__ = ["DTYPE_BYTES", "MAX_LOOKUP_LAYOUTS", "PageLayout"]

# Layouts one Lookup may name: one per tensor/pipeline-parallel rank of an engine. Both
# transports and the store hold a lookup to it (fastwire.MAX_LAYOUTS bounds its body).
MAX_LOOKUP_LAYOUTS = 256

# Bytes per element of each KV dtype we accept. Names follow torch's spelling so the
# connector can pass `str(tensor.dtype).removeprefix("torch.")` straight through.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# Version tag of the canonical encoding below. Bump it if the encoding ever changes, so
# that old and new servers can never mistake each other's pages for their own.
_ENCODING_TAG = b"kvstore.layout.v1"


@dataclasses.dataclass(frozen=True, slots=True)
class PageLayout:
    """The shape of one KV page; two layouts share pages only if every field matches.

    Inside a page the bytes are layer-major: layer 0's slab, then layer 1's, ...; a slab
    is ``[kv_factor, page_tokens, num_kv_heads, head_size]`` contiguous.
    """

    model: str
    num_layers: int
    page_tokens: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    kv_factor: int = 2  # 2 for separate K and V, 1 for MLA's single latent
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    salt: str = ""  # optional namespace, e.g. per deployment or per tenant
    # The weights' revision (a commit, a training step, a fingerprint of the weights'
    # files): pages of two revisions of one model never meet. "" = not known; such a
    # layout keeps the id it had before revisions existed.
    revision: str = ""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid PageLayout: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every reason this layout is invalid (empty when it is valid)."""
        out = []
        if not self.model:
            out.append("model must not be empty")
        if len(self.model.encode()) > 256:
            out.append("model must be at most 256 bytes")
        if len(self.salt.encode()) > 256:
            out.append("salt must be at most 256 bytes")
        if len(self.revision.encode()) > 256:
            out.append("revision must be at most 256 bytes")
        for name in ("num_layers", "page_tokens", "num_kv_heads", "head_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                out.append(f"{name} must be a positive integer, got {value!r}")
        if self.num_layers > 4096 or self.page_tokens > 65536:
            out.append("num_layers must be <= 4096 and page_tokens <= 65536")
        if self.kv_factor not in (1, 2):
            out.append(f"kv_factor must be 1 (MLA) or 2 (K and V), got {self.kv_factor!r}")
        if self.dtype not in DTYPE_BYTES:
            out.append(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < max(self.tp_size, 1):
            out.append(f"tp_rank must be in [0, tp_size), got {self.tp_rank!r}")
        if not isinstance(self.pp_rank, int) or self.pp_rank < 0:
            out.append(f"pp_rank must be >= 0, got {self.pp_rank!r}")
        return out

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's slab of one page."""
        return (self.kv_factor * self.page_tokens * self.num_kv_heads * self.head_size
                * DTYPE_BYTES[self.dtype])

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page (all layers)."""
        return self.num_layers * self.layer_bytes

    def canonical(self) -> bytes:
        """A stable byte encoding: the same on every host, Python version and hash seed."""
        model, dtype, salt = (s.encode() for s in (self.model, self.dtype, self.salt))
        # The revision comes last, length-prefixed, and only when there is one: every
        # layout without one keeps its id (and its stored pages), and the salt's own
        # length prefix keeps the two encodings from ever meeting.
        revision = self.revision.encode()
        return b"".join((
            _ENCODING_TAG,
            struct.pack("<H", len(model)), model,
            struct.pack("<H", len(dtype)), dtype,
            struct.pack("<8I", self.num_layers, self.page_tokens, self.num_kv_heads,
                        self.head_size, self.kv_factor, self.tp_rank, self.tp_size,
                        self.pp_rank),
            struct.pack("<H", len(salt)), salt,
            struct.pack("<H", len(revision)) + revision if revision else b"",
        ))

    @property
    def layout_id(self) -> bytes:
        """16-byte identity of this layout: xxh3-128 of the canonical encoding."""
        return xxhash.xxh3_128_digest(self.canonical())

    @property
    def chain_seed(self) -> bytes:
        """16-byte seed for the connector's chained page keys.

        It leaves out the rank fields (tp_rank, pp_rank) on purpose: every rank of one
        engine then computes the same keys for the same tokens, so the scheduler can ask
        for the hit count over all ranks' layouts with one key list in one RPC. Pages of
        different ranks still never meet, because each rank's layout is its own namespace.
        """
        shared = dataclasses.replace(self, tp_rank=0, pp_rank=0)
        return xxhash.xxh3_128_digest(b"kvstore.chain.v1" + shared.canonical())
