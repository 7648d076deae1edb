"""Per-RPC latency and outcome counts, kept per thread in plain ints, summed at scrape.

Why not prometheus_client's Histogram and Counter: each observation there walks the
buckets in Python and takes a lock per value it bumps (the histogram's sum, one bucket,
the counter), more than a fast-path call's own framing costs. Here the thread that served
the call bumps an int and a float in a list of its own (no lock: no other thread writes
it), several times cheaper a call, and the collector reads every thread's lists when
Prometheus scrapes. A reading may be one call behind a thread still serving; no
call is ever lost or counted twice.

The series are the ones the Histogram and Counter exposed: kvstore_rpc_duration_seconds
(by method) and kvstore_rpc_total (by method and gRPC code).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

__all__ = ["BUCKETS", "RpcTally"]

# Upper bounds of kvstore_rpc_duration_seconds' buckets, in seconds (then +Inf).
BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0)
_FIRST, _SECOND = BUCKETS[0], BUCKETS[1]
_SUM = len(BUCKETS) + 1          # a row: one count per bucket and +Inf, the seconds,
_REFUSED = _SUM + 1              # and calls refused before a handler ran (no latency)

Row = list                        # [count per bucket..., count +Inf, seconds, refused]
Key = tuple[str, grpc.StatusCode]


def _row() -> Row:
    return [0] * (len(BUCKETS) + 1) + [0.0, 0]


class _Rows:
    """One thread's rows, written by that thread alone."""

    __slots__ = ("rows", "thread")

    def __init__(self) -> None:
        self.rows: dict[Key, Row] = {}
        self.thread = threading.current_thread()


class RpcTally:
    """observe() and refused() from any thread; a Prometheus collector of their sums."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()      # guards _threads and _ended
        self._threads: list[_Rows] = []
        # Rows of threads that ended, folded in at a scrape, so that a server that
        # serves each connection on a thread of its own keeps one set of rows, not one
        # a connection.
        self._ended: dict[Key, Row] = {}

    def _rows(self) -> dict[Key, Row]:
        try:
            return self._local.rows
        except AttributeError:
            mine = _Rows()
            with self._lock:
                self._threads.append(mine)
            self._local.rows = mine.rows
            return mine.rows

    def observe(self, method: str, seconds: float, code: grpc.StatusCode) -> None:
        try:
            rows = self._local.rows
        except AttributeError:
            rows = self._rows()
        row = rows.get((method, code))
        if row is None:
            row = rows[(method, code)] = _row()
        # le: at most the bound. A fast-path call mostly falls in the first bucket or
        # two: compared, not searched.
        row[0 if seconds <= _FIRST else 1 if seconds <= _SECOND
            else bisect.bisect_left(BUCKETS, seconds)] += 1
        row[_SUM] += seconds

    def refused(self, method: str, code: grpc.StatusCode) -> None:
        """A call refused before any handler ran (auth): counted, with no latency."""
        rows = self._rows()
        row = rows.get((method, code))
        if row is None:
            row = rows[(method, code)] = _row()
        row[_REFUSED] += 1

    def totals(self) -> dict[Key, Row]:
        """Every thread's rows summed (and those of ended threads folded in for good)."""
        with self._lock:
            live = []
            for mine in self._threads:
                if mine.thread.is_alive():
                    live.append(mine)
                else:                   # nobody writes its rows any more
                    _add(self._ended, list(mine.rows.items()))
            self._threads = live
            out = {key: list(row) for key, row in self._ended.items()}
            for mine in live:
                # list() of a dict's items runs no Python code, so the owner cannot add
                # a key in the middle of it; a row is copied the same way.
                _add(out, [(key, list(row)) for key, row in list(mine.rows.items())])
        return out

    def collect(self) -> Iterator[HistogramMetricFamily | CounterMetricFamily]:
        totals = self.totals()
        by_method: dict[str, Row] = {}
        for (method, _), row in totals.items():
            _add(by_method, [(method, row)])
        hist = HistogramMetricFamily("kvstore_rpc_duration_seconds", "RPC handling time",
                                     labels=["method"])
        for method, row in sorted(by_method.items()):
            if not any(row[:_SUM]):
                continue                  # only refusals: no latency observed
            cumulative, buckets = 0, []
            for bound, count in zip((*BUCKETS, float("inf")), row[:_SUM], strict=True):
                cumulative += count
                buckets.append((_bound(bound), cumulative))
            hist.add_metric([method], buckets, row[_SUM])
        yield hist
        calls = CounterMetricFamily("kvstore_rpc", "RPCs handled, by method and status code",
                                    labels=["method", "code"])
        for (method, code), row in sorted(totals.items(), key=lambda kv: (kv[0][0],
                                                                           kv[0][1].name)):
            calls.add_metric([method, code.name], sum(row[:_SUM]) + row[_REFUSED])
        yield calls


def _add(into: dict, rows: list) -> None:
    for key, row in rows:
        have = into.get(key)
        if have is None:
            into[key] = list(row)
        else:
            for i, value in enumerate(row):
                have[i] += value


def _bound(bound: float) -> str:
    """A bucket's le label as prometheus_client writes it (0.0001, 1.0, +Inf)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))
