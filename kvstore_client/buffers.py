"""Page buffers: accept numpy, torch CPU tensors and bytes; scatter layer-major streams."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["LayerMajorWriter", "as_uint8", "byte_view", "page_aligned_empty"]


def as_uint8(data, nbytes: int, *, writable: bool = False, what: str = "pages") -> np.ndarray:
    """A flat uint8 numpy view of `data` (no copy) holding exactly nbytes.

    Accepts numpy arrays, objects with `.numpy()` (torch CPU tensors; viewed, not
    copied), and anything supporting the buffer protocol (bytes, bytearray, mmap).
    """
    if hasattr(data, "numpy") and not isinstance(data, np.ndarray):
        if getattr(data, "device", None) is not None and str(data.device) != "cpu":
            raise ValueError(f"{what} must be in CPU memory, got a tensor on {data.device}")
        if not data.is_contiguous():
            raise ValueError(f"{what} tensor must be contiguous")
        data = data.detach().view(-1).numpy().view(np.uint8)
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError(f"{what} array must be C-contiguous")
        arr = data.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(data, dtype=np.uint8)
    if arr.nbytes != nbytes:
        raise ValueError(f"{what} hold {arr.nbytes} bytes, expected {nbytes}")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} buffer is read-only")
    return arr


def byte_view(data, nbytes: int, *, writable: bool = False, what: str = "pages"
              ) -> memoryview:
    """as_uint8(...).data: a flat byte view of `data` (no copy) holding exactly nbytes,
    what a transport sends from or receives into. A C-contiguous numpy array (what an
    engine passes per layer) is cast by memoryview alone, a fraction of numpy's
    reshape, view and export; anything else, or a mismatch, goes through as_uint8 and
    its errors."""
    if type(data) is np.ndarray:
        # memoryview's cast refuses what is not C-contiguous (TypeError), so numpy's
        # flags object, made anew at each read, need not be asked first.
        try:
            view = memoryview(data).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
        except (TypeError, ValueError, NotImplementedError):   # or a format it lacks
            view = None
        if view is not None and view.nbytes == nbytes and not (writable and view.readonly):
            return view
    return as_uint8(data, nbytes, writable=writable, what=what).data


def page_aligned_empty(shape: tuple[int, ...], page: int = 4096) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on a page boundary (a view into a
    slightly larger allocation, so freed memory is reused like any numpy array's)."""
    nbytes = int(np.prod(shape))
    raw = np.empty(nbytes + page, dtype=np.uint8)
    start = -raw.ctypes.data % page
    return raw[start:start + nbytes].reshape(shape)


class LayerMajorWriter:
    """Places a layer-major byte stream (every page's layer 0, then layer 1, ...) into
    per-layer destinations `dest(layer) -> (n_pages, layer_bytes) uint8 view`.

    Whole slabs inside a chunk are copied with one vectorised assignment; only the
    partial slabs at a chunk's edges are copied piecewise.
    """

    def __init__(self, n_pages: int, num_layers: int, layer_bytes: int,
                 dest: Callable[[int], np.ndarray],
                 on_layer: Callable[[int], None] | None = None) -> None:
        self.n = n_pages
        self.layers = num_layers
        self.lb = layer_bytes
        self.layer_total = n_pages * layer_bytes
        self.total = self.layer_total * num_layers
        self.pos = 0
        self._dest = dest
        self._on_layer = on_layer
        self._layer = -1
        self._view: np.ndarray = np.empty(0, np.uint8)    # layer self._layer's destination

    def write(self, payload) -> None:
        src = np.frombuffer(payload, dtype=np.uint8)
        if self.pos + src.size > self.total:
            raise ValueError(f"stream longer than expected {self.total} bytes")
        while src.size:
            layer, q = divmod(self.pos, self.layer_total)
            if layer != self._layer:
                self._layer = layer
                view = self._dest(layer)
                # Flatten only a contiguous view: reshaping a strided one would copy.
                self._view = view.reshape(-1) if view.flags.c_contiguous else view
            take = min(self.layer_total - q, src.size)
            view = self._view
            if view.ndim == 1:
                view[q:q + take] = src[:take]
            else:  # a strided (n, lb) view: copy slab by slab
                self._strided(view, q, src[:take])
            src = src[take:]
            self.pos += take
            if q + take == self.layer_total and self._on_layer is not None:
                self._on_layer(layer)

    def _strided(self, view: np.ndarray, q: int, src: np.ndarray) -> None:
        lb = self.lb
        page, off = divmod(q, lb)
        if off:
            head = min(lb - off, src.size)
            view[page, off:off + head] = src[:head]
            src = src[head:]
            page += 1
        whole = src.size // lb
        if whole:
            view[page:page + whole] = src[: whole * lb].reshape(whole, lb)
            src = src[whole * lb:]
            page += whole
        if src.size:
            view[page, : src.size] = src

    @property
    def done(self) -> bool:
        return self.pos == self.total
