"""What a caller holds while copies are in flight: one event per layer, polled or waited."""

from __future__ import annotations

import torch

from .runtime import query, sync

__all__ = ["LoadHandle", "SaveHandle"]


class LoadHandle:
    """The layers of one load in flight: one event per layer (None on CPU: all done)."""

    def __init__(self, device: torch.device, events: list | None, keep: tuple) -> None:
        self._device = device
        self._events = events
        self._keep = keep        # host array, index tensors: alive until the copies end
        # The event last waited for, and the stream that waited: the layers of one kernel
        # launch share its event, and a second wait for it there is a host call for nothing.
        self._waited: torch.cuda.Event | None = None
        self._waited_on: torch.cuda.Stream | None = None

    @property
    def num_layers(self) -> int:
        return len(self._events) if self._events is not None else 0

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer`'s copies (no host sync)."""
        if self._events is None:
            return
        if not 0 <= layer < len(self._events):
            raise IndexError(f"layer {layer} out of range [0, {len(self._events)})")
        event = self._events[layer]
        stream = torch.cuda.current_stream(self._device)
        if event is self._waited and stream == self._waited_on:
            return
        stream.wait_event(event)
        self._waited, self._waited_on = event, stream

    def done(self) -> bool:
        """Whether every layer has landed (polls; raises TransferError on a CUDA error)."""
        if self._events is None:
            return True
        finished = query(self._events[-1])   # one stream: the last event implies all
        if finished:
            self._keep = ()
        return finished

    def synchronize(self) -> None:
        """Block the host until every layer has landed."""
        if self._events is not None:
            sync(self._events[-1])
            self._keep = ()


class SaveHandle(LoadHandle):
    """The saves enqueued between two finish_save calls (same polling as a load)."""
