"""A step's Reserve, made on a thread of its own while the forward computes.

A step's saves need store slots before their first copy. Made before the forward, the
Reserve's round trip delayed the forward by all of it, a large part of what a short
miss that saves costs over a recompute. Made here, it overlaps the first layers' compute
instead (the miss+save breakdown in docs/perf/e2e-ec25c98d81.json shows what is left of
it in `bind`). A layer whose save hook runs before the answer is in is
owed: its copy is launched when a later hook, or the end of the step, takes the answer.

A layer's copy launched after its own hook is still right: transfer.save_layer orders
the copy after the engine's stream as it is at the launch, which is past that layer's
compute, and a layer's KV is not rewritten within a step. Several owed layers launched
in one go form the same runs of consecutive layers as hooks one a layer.

Without the shared pool the same thread asks the store which of the step's pages it holds
(one Exists, connector.worker), so that only the others are copied out and sent.

At most one Reserve is in flight, and the worker takes its answer within its step (the
end of the step waits for it; the client's own timeout bounds that wait, as it bounded
the call when it was made inline). The answer, good or bad, is the worker's to act on.

The Reserve runs on this module's thread, everything else on the worker's thread.
KVStoreClient is thread-safe. Its fast path makes lease calls one at a time on each of
two connections (kvstore_client.fastpath's lease lanes): Reserve, Commit and Abort on
one, Acquire and Release on the other, so the step's Acquire does not wait behind its
Reserve. On one connection it did, while no copy had begun. A step with loads takes the answer once they are launched (worker.start_load).

The thread needs the GIL to send the Reserve and again to read its answer, and a short
forward is Python on the engine's thread from end to end (launches and hooks): CPython
hands the GIL to a waiting thread only after its switch interval (5 ms), longer than a
1B model's forward at 1k tokens, so the answer was often still unread at the step's end
and the end of the step waited for it. So the engine's thread lets it run (nudge) after
handing it the Reserve and at each save hook while the answer is out: the thread's own
work instead of a wait.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..meta import SaveSpec

__all__ = ["Answer", "StepReserve"]


@dataclasses.dataclass(slots=True)
class Answer:
    """What a step's Reserve came back with."""

    specs: list[SaveSpec]          # the saves it reserved for, in reservation order
    began: float                   # time.monotonic() when it was handed to the thread
    owed: list[int]                # layers whose hooks ran before it, in hook order
    call: concurrent.futures.Future   # the Reserve on the thread

    def reservation(self) -> Any:
        """The reservation (or what the call returned: the buffer path asks an Exists
        here instead); raises what the call raised."""
        return self.call.result()


class StepReserve:
    """One thread for the step's Reserve (started on first use) and the layers owed.
    Called from the worker's thread only; the Reserve itself runs on the pool's thread."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._answer: Answer | None = None      # the step's Reserve, until taken

    @property
    def pending(self) -> bool:
        """A Reserve whose answer the worker has not taken."""
        return self._answer is not None

    def start(self, reserve: Callable[[], Any], specs: list[SaveSpec]) -> None:
        """Ask for the Reserve on the thread."""
        if self._answer is not None:
            raise RuntimeError("the previous step's Reserve was not taken")
        began = time.monotonic()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kvstore-reserve")
        self._answer = Answer(specs, began, [], self._pool.submit(reserve))
        self.nudge()

    def nudge(self) -> None:
        """Let the Reserve's thread run now if it waits for the GIL (see above): sleep(0)
        releases it; a few microseconds when no thread waits."""
        if self._answer is not None and not self._answer.call.done():
            time.sleep(0)

    def ready(self) -> bool:
        """The answer is in (taking it will not wait)."""
        return self._answer is not None and self._answer.call.done()

    def owe(self, layer: int) -> None:
        """The layer's save waits for the answer."""
        if self._answer is None:
            raise RuntimeError("no Reserve to owe a layer to")
        self._answer.owed.append(layer)

    def take(self) -> Answer | None:
        """The answer, waited for if not in yet; None when no Reserve was made."""
        answer, self._answer = self._answer, None
        if answer is not None:
            concurrent.futures.wait([answer.call])
        return answer

    def close(self) -> None:
        """Ends the thread once its Reserve (if any) has returned."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
