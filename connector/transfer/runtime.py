"""The CUDA runtime beneath the copies: host registration, pinned buffers, events, errors.

Everything here is a thin wrapper over torch's CUDA bindings or the runtime torch loaded
(for the calls torch has no binding of); on a machine without CUDA each is a no-op or
plain host memory, so the package imports and runs on CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref

import numpy as np
import torch

__all__ = ["HostRegistration", "TransferError", "clear_cuda_error", "cudart", "on_device",
           "on_stream", "pinned_empty", "query", "record", "sync"]

_CUDA_ERROR_ALREADY_REGISTERED = 712          # cudaErrorHostMemoryAlreadyRegistered


class TransferError(RuntimeError):
    """A copy failed on the device (a CUDA error surfaced by a launch, query or sync)."""


# -- host memory ---------------------------------------------------------------------------
class HostRegistration:
    """`mem` registered with cudaHostRegister for as long as this object is open.

    Registering makes the pages of the server's pool DMA-able and gives them a UVA
    address the GPU can read and write, so copies from the pool run at PCIe speed, as from
    cudaHostAlloc memory. It costs time proportional to the size (635 ms for an 11 GiB
    pool: docs/perf/load-e21a8ae119.json), so register once per mapping, at attach, never
    per request.
    Without CUDA this is a no-op object.
    Memory some other registration already covers is used as is and not unregistered.

    One dropped without close() is unregistered when it is collected, before its memory
    can go: a registration left on memory that was then unmapped stays in the driver, and
    the next pinned allocation the process makes at those addresses fails ("resource
    already mapped"), reported by whatever CUDA call comes next: the engine's own model
    code (seen on an H100 after the connector's tests left workers unclosed).
    """

    def __init__(self, mem: np.ndarray) -> None:
        self.mem = mem              # kept: the mapping must outlive the registration
        self.ptr = int(mem.ctypes.data) if mem.size else 0
        self.nbytes = int(mem.nbytes)
        self.registered = False     # True: this object registered it and must unregister
        if not torch.cuda.is_available() or not self.nbytes:
            return
        rc = _rc(torch.cuda.cudart().cudaHostRegister(self.ptr, self.nbytes, 0))
        if rc == _CUDA_ERROR_ALREADY_REGISTERED:
            clear_cuda_error()
            return
        if rc != 0:
            clear_cuda_error()
            raise TransferError(f"cudaHostRegister of {self.nbytes} bytes at {self.ptr:#x} "
                                f"failed with CUDA error {rc}")
        self.registered = True
        # The finalizer holds mem, so the memory stays mapped until it has run; not at
        # interpreter exit (the CUDA context may be gone by then, and exit unmaps all).
        self._unregister = weakref.finalize(self, _unregister, self.ptr, mem)
        self._unregister.atexit = False

    def close(self) -> None:
        """Unregister; waits for the device first, since a copy may still use the memory."""
        if self.registered:
            self.registered = False
            self._unregister()

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pinned_empty(nbytes: int, device: torch.device) -> np.ndarray:
    """A uint8 host buffer of nbytes, page-locked when `device` is a CUDA device (so
    copies to and from it run at PCIe speed and may be asynchronous)."""
    pin = device.type == "cuda"
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).numpy()


def _unregister(ptr: int, mem: np.ndarray) -> None:
    """cudaHostUnregister(ptr) once the device is done with it; mem: kept mapped until
    then (HostRegistration's finalizer)."""
    torch.cuda.synchronize()
    rc = _rc(torch.cuda.cudart().cudaHostUnregister(ptr))
    if rc != 0:
        clear_cuda_error()
        raise TransferError(f"cudaHostUnregister failed with CUDA error {rc}")


# -- the runtime ---------------------------------------------------------------------------
def _rc(value) -> int:
    return int(getattr(value, "value", value))


def _libcudart() -> ctypes.CDLL:
    major = (torch.version.cuda or "0").split(".")[0]
    return ctypes.CDLL(f"libcudart.so.{major}")


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded, for cudaMemcpy2DAsync (torch binds no 2D copy) and
    cudaMemcpyAsync between raw addresses (uploads.py)."""
    lib = _libcudart()
    fn = lib.cudaMemcpy2DAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    fn = lib.cudaMemcpyAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lib


def clear_cuda_error() -> None:
    """Read off the runtime's "last error" after a failed call: a later unrelated check
    (torch's, after a launch) would report it otherwise. torch binds no
    cudaGetLastError, so call the runtime torch loaded."""
    with contextlib.suppress(OSError, AttributeError):
        _libcudart().cudaGetLastError()


# -- streams and events ----------------------------------------------------------------------
def on_stream(stream, device: torch.device | None):
    """Run on `stream` after the current stream's work so far (nothing on CPU); with
    device None, on `stream` without waiting for anything."""
    if stream is None:
        return contextlib.nullcontext()
    if device is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


def on_device(device: torch.device):
    """Make `device` this thread's current CUDA device (nothing on CPU): a thread other
    than the engine's starts on device 0."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def record(stream):
    """An event recorded on `stream` now (None without a stream)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def query(event) -> bool:
    try:
        return event.query()
    except RuntimeError as exc:
        raise TransferError(f"KV copy failed on the device: {exc}") from exc


def sync(event) -> None:
    try:
        event.synchronize()
    except RuntimeError as exc:
        raise TransferError(f"KV copy failed on the device: {exc}") from exc
