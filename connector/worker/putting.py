"""The buffer path's Puts, sent on threads of their own while the next forward computes.

Without the shared pool a request's pages are copied out to a pinned buffer and sent by
one Put once the copies have landed (connector.worker). Sent on the engine's thread at
the step boundary that found the copies landed, the Put held the step for as long as its
bytes took on the wire: a 32k-token 8B prompt prefilled in 8k-token chunks sends 1 GiB a
chunk, and the chunks' Puts added about a second to the prompt's first token over a
recompute in the H100 record (docs/e2e_h100.md, `--remote`). Here:

    start(save)   the save's Put (save.commit) on a thread, at the boundary that found
                  its copies landed
    done(wait)    the Puts that have returned, with what each returned or raised: the
                  worker counts them, or trips its breaker on an error (its own thread).
                  The worker waits for every Put still out at the end of the next
                  step's forward (wait_for_save): a Put has one forward to hide behind,
                  no more, so Puts never pile up beyond one step's, a link slower than
                  the prefill slows the steps as before, and a Put's pages are stored by
                  the end of the step after it was started, as tests and engines see it
    busy()        requests whose Put is still out: the engine keeps their blocks until
                  it is answered (the worker's `sent` waits for them too)
    close()       ends the threads (take done(wait=True) first)

The buffer stays alive until its Put returns (the save holds it). Puts of different
requests go out side by side over the client's pooled connections (THREADS at once).
"""

from __future__ import annotations

import concurrent.futures

from .pending import PendingSave

__all__ = ["THREADS", "Puts"]

THREADS = 2            # Puts sent at once, each on a pooled connection of the client


class Puts:
    """Puts under way, oldest first. Called from the worker's thread only."""

    def __init__(self, threads: int = THREADS) -> None:
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._out: list[tuple[concurrent.futures.Future, PendingSave]] = []

    def start(self, save: PendingSave) -> None:
        """Send the save's Put (save.commit) on a thread."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix="kvstore-put")
        self._out.append((self._pool.submit(save.commit), save))

    def done(self, wait: bool = False) -> list[tuple[PendingSave, object]]:
        """The finished Puts, oldest first: (save, what it returned, or the exception it
        raised). wait: every Put still out is waited for first."""
        if wait and self._out:
            concurrent.futures.wait([future for future, _ in self._out])
        finished, left = [], []
        for future, save in self._out:
            if not future.done():
                left.append((future, save))
                continue
            exc = future.exception()
            finished.append((save, exc if exc is not None else future.result()))
        self._out = left
        return finished

    def busy(self) -> set[str]:
        """Requests with a Put still out."""
        out: set[str] = set()
        for _, save in self._out:
            out |= save.req_ids
        return out

    def __len__(self) -> int:
        return len(self._out)

    def close(self) -> None:
        """End the threads once every Put has returned (take done(wait=True) first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
