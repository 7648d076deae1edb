"""The worker half: moves pages between the store and the engine's paged KV tensors.

It follows the scheduler half's plan for each step (meta.StepMeta); all CUDA work is in
connector.transfer, beside this package. Its parts, one idea each:

    half          WorkerHalf: the engine's worker calls, in the order it makes them
    groupworkers  one worker half per KV-cache group, seen by the engine as one worker
    loading       a step's loads from the shared pool under one Acquire
    remote        loads from a store on another host, layer by layer as they arrive
    staging       the ring of pinned slabs remote loads receive into
    deadline      when a remote load is late
    hostmem       the pool mappings the worker copies through, registered with CUDA
    reserving     a step's Reserve, on a thread of its own beside the forward
    pending       saves in flight, and when their reservations may be committed
    outcomes      what the worker knows of loads' outcomes, for the saves that read them
    sending       saves to a store on another host: which pages cross the network
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["SharedStore", "WorkerHalf", "WorkerStats", "layer_order"]

if TYPE_CHECKING:
    from .half import SharedStore, WorkerHalf, WorkerStats, layer_order


def __getattr__(name: str) -> Any:
    # Imported when first asked for, not with the package: a part (pending, outcomes,
    # ...) is imported without what the half needs (torch, through transfer).
    if name in __all__:
        from . import half
        return getattr(half, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
