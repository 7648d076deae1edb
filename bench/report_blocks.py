"""Figures in the README and docs/, rendered from the records between markers.

A document holds a figure as a block that `kvstore-bench report` fills from docs/perf/:

    <!-- kvstore-bench report: NAME -->
    ...what VIEWS[NAME] renders (never edited by hand)...
    <!-- end -->

so a figure in prose is always one a recorded run printed, with its machine and command
beside it, and a new record changes the docs by `kvstore-bench report`, not by hand.
A view picks lines of a record's output (Pick): a row of one of its tables, given by its
first cells, with the columns named; or a line of text, given by how it starts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from .record import Record

__all__ = ["DOCS", "VIEWS", "Pick", "Stale", "fill", "stale_blocks"]

# The documents whose blocks `kvstore-bench report` fills (paths from the repository root).
DOCS = ("README.md", "docs/connector.md", "docs/far.md", "docs/fastpath.md")

_BLOCK = re.compile(r"(<!-- kvstore-bench report: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
                    r"(<!-- end -->)", re.S)


class Stale(ValueError):
    """A block names no view, or its record is missing."""


@dataclasses.dataclass(frozen=True, slots=True)
class Pick:
    """One figure of a record: a table row whose first cells are `row` (with `cols`, the
    columns to show), or else the first line that starts with `row` (after the first line
    that starts with `after`, if given), cut before `cut`."""

    row: str
    cols: tuple[str, ...] = ()
    cut: str = ""
    after: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class _Table:
    header: list[str]
    rows: list[list[str]]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(output: str) -> list[_Table]:
    """The markdown tables of a bench's output."""
    lines = output.splitlines()
    tables = []
    for i in range(len(lines) - 1):
        if lines[i].startswith("|") and lines[i + 1].startswith("|-"):
            rows = []
            for line in lines[i + 2:]:
                if not line.startswith("|"):
                    break
                rows.append(_cells(line))
            tables.append(_Table(_cells(lines[i]), rows))
    return tables


def _pick(record: Record, pick: Pick) -> str:
    if pick.cols:
        for table in _tables(record.output):
            if not all(c in table.header for c in pick.cols):
                continue
            for row in table.rows:
                joined = " ".join(row)
                if joined == pick.row or joined.startswith(pick.row + " "):
                    shown = [f"{c} {row[table.header.index(c)]}" for c in pick.cols]
                    return f"{pick.row}: " + ", ".join(shown)
    else:
        lines = [line.strip() for line in record.output.splitlines()]
        if pick.after:
            starts = [i for i, line in enumerate(lines) if line.startswith(pick.after)]
            lines = lines[starts[0] + 1:] if starts else []
        for line in lines:
            if line.startswith(pick.row):
                text = " ".join(line.split())         # a column's padding, collapsed
                return text.split(pick.cut)[0].rstrip() if pick.cut else text
    raise Stale(f"{record.file_name()}: no {pick.row!r}"
                + (f" with {', '.join(pick.cols)}" if pick.cols else ""))


def machine_name(machine: str) -> str:
    """The short name the docs use for a record's machine."""
    if "H200" in machine:
        return "H200"
    if "H100" in machine:
        return "H100"
    if machine.startswith("2 cores") and "no GPU" in machine:
        return "dev"
    return machine


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One row of a figures table: what was measured, the record, the figures picked."""

    what: str
    record: str                 # the record's file name in docs/perf/, without .json
    picks: tuple[Pick, ...]


def _table(rows: Sequence[Row]) -> Callable[[dict[str, Record]], str]:
    def render(records: dict[str, Record]) -> str:
        lines = ["| what | machine | command | figures |", "|---|---|---|---|"]
        for row in rows:
            r = records.get(row.record)
            if r is None:
                raise Stale(f"no record docs/perf/{row.record}.json")
            figures = "; ".join(_pick(r, p) for p in row.picks)
            lines.append(f"| {row.what} | {machine_name(r.machine)} | `{r.command}` "
                         f"| {figures} |")
        return "\n".join(lines) + "\n"
    return render


_E2E = ("recompute", "DRAM hit", "recompute / DRAM hit")
_LOAD = ("load/H2D", "save/D2H")

HEADLINES = (
    Row("time to first token, recompute -> DRAM hit (ms), 8B and 1B bf16", "e2e-fa5a8f0671",
        tuple(Pick(f"{m} {n}", _E2E) for m, n in [("8b", 256), ("8b", 1024), ("8b", 4096),
                                                    ("8b", 32768), ("1b", 256), ("1b", 4096)])),
    Row("pool -> paged GPU cache, against a pinned `cudaMemcpy` in the same run",
        "load-6f952bee22",
        (Pick("1024", _LOAD), Pick("16384", _LOAD), Pick("32768", _LOAD),
         Pick("CopyMethod.KERNEL alone"))),
    Row("fast-path Get of 1 MiB pages, one connection (GB/s; ratios per run, median)",
        "fastpath-713bcc3c98",
        (Pick("get 1 MiB pages GB/s", ("fast", "raw", "iperf3", "grpc")),
         Pick("get vs raw", ("median",)), Pick("get x4 vs raw", ("median",)),
         Pick("put vs raw send", ("median",)),
         Pick("one 64 KiB page p50 us", ("fast", "grpc")),
         Pick("acquire+release 1 page p50 us", ("fast unix", "grpc")))),
    Row("fast path per call, as an engine calls it (fast / raw TCP peer, same run, every "
        "thread of both on one CPU)",
        "fastpath-6b4f7b2b9e",
        (Pick("64 KiB 1", ("get fast/raw", "put fast/raw")),
         Pick("64 KiB 8", ("get fast/raw", "put fast/raw")),
         Pick("64 KiB 32", ("get fast/raw", "put fast/raw")),
         Pick("1 MiB 1", ("get fast/raw", "put fast/raw")),
         Pick("4 MiB 32", ("get fast/raw", "put fast/raw")),
         Pick("get of one 64 KiB page", ("fast p50 us", "raw p50 us")),
         Pick("lookup of 16 keys", ("fast p50 us", "raw p50 us")),
         Pick("leased lookup of 16 keys + release not waited for",
              ("fast p50 us", "raw p50 us")))),
    Row("a store in another network namespace, over a veth pair", "fastpath-netns-8c625dd33e",
        (Pick("get 1 MiB pages, 1 connection, GB/s", ("fast path", "raw socket", "gRPC")),
         Pick("put 1 MiB pages, 1 connection, GB/s", ("fast / raw",)),
         Pick("one 64 KiB page p50 us", ("fast path", "raw socket", "gRPC")))),
    Row("fast path, one server, N client processes (aggregate GB/s)", "fastpath-8eebb7bd03",
        tuple(Pick(str(n), ("fast path GB/s (aggregate)", "gRPC GB/s (aggregate)"))
              for n in (1, 2, 4, 8))),
    Row("time to first token over TCP only (no shared pool), 8B (ms)", "e2e-947e218f15",
        (Pick("8b 1024", _E2E), Pick("8b 4096", _E2E), Pick("8b 32768", _E2E))),
    Row("64 new requests sharing a stored 2,048-token prompt, scheduler loop",
        "admit-a516f10033",
        (Pick("sync", ("loop ms", "per request us")), Pick("sync, gRPC", ("loop ms",)),
         Pick("prefetch 1", ("loop ms",)))),
    Row("shared-memory Get and Put, 1 MiB pages", "shm-2f6bc72e1b",
        (Pick("get: shared memory"), Pick("put: shared memory"))),
    Row("SIGKILLs under puts, spills and deletes", "kill-test-d0b7f9e3f9",
        (Pick("kill test:"),)),
    Row("8 clients for 60 s, every byte checked", "load-test-4f85f3f71f",
        (Pick("errors 0"), Pick("server RSS:", cut=";"))),
    Row("requests at every limit", "limits-3f4ad95abf",
        (Pick("server RssAnon:", cut=", with"), Pick("store lock: longest hold", cut=";"))),
)

def _figures(record: str, picks: Sequence[Pick],
             *more: tuple[str, Sequence[Pick]]) -> Callable[[dict[str, Record]], str]:
    """Records' figures as lines of prose: the command, the machine, the picks."""
    def render(records: dict[str, Record]) -> str:
        lines = []
        for name, chosen in ((record, picks), *more):
            r = records.get(name)
            if r is None:
                raise Stale(f"no record docs/perf/{name}.json")
            lines.append(f"`{r.command}` ({machine_name(r.machine)}, {r.date[:10]}): "
                         + "; ".join(_pick(r, p) for p in chosen) + ".")
        return "\n\n".join(lines) + "\n"
    return render


def _newest(bench: str, *has: str, remote: bool | None = None,
            required: bool = True) -> Callable[[dict[str, Record]], str]:
    """The lines starting with one of `has` of the newest record of `bench` that prints
    the first (with or without --remote where `remote` says), as prose with its command
    and machine: for figures a later run of other lengths or on another card supersedes.
    required=False: nothing where no record prints one yet."""
    def render(records: dict[str, Record]) -> str:
        found = [r for r in records.values() if r.bench == bench
                 and (remote is None or ("--remote" in r.argv) == remote)
                 and any(line.startswith(has[0]) for line in r.output.splitlines())]
        if not found:
            if required:
                raise Stale(f"no {bench} record prints {has[0]!r}")
            return ""
        r = max(found, key=lambda r: r.date)
        picked = [" ".join(line.split()) for line in r.output.splitlines()
                  if line.startswith(has)]          # str.startswith takes the tuple
        return (f"`{r.command}` ({machine_name(r.machine)}, {r.date[:10]}): "
                + "; ".join(picked) + ".\n")
    return render


def _joined(*views: Callable[[dict[str, Record]], str]) -> Callable[[dict[str, Record]], str]:
    def render(records: dict[str, Record]) -> str:
        return "\n".join(text for text in (v(records) for v in views) if text)
    return render


_TLS = ("plain", "TLS")
# The whole `kvstore-bench fastpath --sweep`: every page size and pages a call, and the
# one-call round trips, each fast against the raw peer of the same run; with the threads
# where the scheduler puts them, and all on one CPU (--one-cpu).
_SWEEP_RECORD = "fastpath-3fd6c1cbbc"
_SWEEP_ONE_CPU_RECORD = "fastpath-6b4f7b2b9e"
# The same on one CPU with cubic at both ends (--congestion cubic): bbr's state of each
# connection taken out of the large calls (docs/fastpath.md, TCP congestion control).
_SWEEP_CUBIC_RECORD = "fastpath-351585bd09"
_SWEEP = (
    *(Pick(f"{size} {n}", ("get fast/raw", "put fast/raw"))
      for size in ("64 KiB", "1 MiB", "4 MiB") for n in (1, 8, 32, 128)),
    *(Pick(what, ("fast p50 us", "raw p50 us"))
      for what in ("get of one 64 KiB page", "get of one 1 MiB page", "lookup of 16 keys",
                   "leased lookup of 16 keys + release",
                   "leased lookup of 16 keys + release not waited for")))
# `kvstore-bench fastpath --split` (and --one-cpu): each end's CPU a call, user and
# system time, fast against raw.
_SPLIT = tuple(Pick(f"{call} {end}", ("raw user", "fast user", "fast - raw, user",
                                      "fast - raw, system"))
               for call in ("get 1 x 64 KiB", "get 8 x 64 KiB", "lookup of 16 keys")
               for end in ("far end", "client"))
_FAR_CLIENTS = (
    *(Pick(name, after="lookup of 4096 keys") for name in (
        "glide EVAL_RO/bucket", "redis-py EVAL_RO/bucket", "glide EXISTS/key",
        "redis-py EXISTS/key", "ours exists")),
    *(Pick(name, after="get 64 pages of 1024 KiB") for name in ("glide MGET", "redis-py MGET",
                                                                "ours get")))
_ADMIT = (Pick("sync", ("loop ms",)), Pick("prefetch 1", ("loop ms", "steps to answer all")))

# view name -> what it renders from the records (by file name, without .json)
VIEWS: dict[str, Callable[[dict[str, Record]], str]] = {
    "headlines": _table(HEADLINES),
    "fastpath-tls": _figures("fastpath-8e2f78568d", (
        Pick("get 1 MiB pages, 1 connection, GB/s", (*_TLS, "TLS / plain (per run)")),
        Pick("get 1 MiB pages, 4 connections, GB/s", _TLS),
        Pick("put 1 MiB pages, 1 connection, GB/s", _TLS),
        Pick("one 64 KiB page p50 us", _TLS))),
    "admit": _figures("admit-a516f10033", _ADMIT, ("admit-827135c024", _ADMIT)),
    "admit-extras": _figures("admit-aba30b882e", (
        Pick("sync", ("loop ms",)), Pick("sync +", ("loop ms",)),
        Pick("prefetch 1", ("loop ms",)), Pick("prefetch + 1", ("loop ms",)),
        Pick("loop ms, sync + / sync:"), Pick("loop ms, prefetch + / prefetch at a 1 ms"))),
    "short-hits": _figures("e2e-ec25c98d81", (
        *(Pick(f"{m} {n}", _E2E) for m, n in [("8b", 256), ("8b", 1024), ("1b", 256),
                                              ("1b", 1024), ("1b", 4096)]),
        Pick("8b 256", ("connector", "rest")))),
    "hybrid-windows": _newest("hybrid", "windowed / every page at"),
    "hit-floors": _joined(
        _newest("e2e", "floor under hits", "declined below the floor", remote=False,
                required=False),
        _newest("e2e", "floor under hits", "declined below the floor", remote=True)),
    "lookup-stream": _figures("store-0e63aae249", (
        Pick("1,000,000 4096 packed", ("lookup p50 ms", "p99 ms")),
        Pick("1,000,000 4096 packed, unary", ("lookup p50 ms", "p99 ms")))),
    "far-through-server": _figures("far-4e023a4575", tuple(
        Pick(f"{size} KiB get through kvstore ({via}) vs glide MGET{parts}")
        for size in (1024, 64) for via, parts in [("shm", ""), ("fast path", ""), ("gRPC", ""),
                                                  ("shm", " in parallel parts")])),
    "far-clients": _figures("far-4e023a4575", _FAR_CLIENTS, ("far-4d2ee3a096", _FAR_CLIENTS)),
    "far-failover": _figures("far-failover-f9354575e2", (
        Pick("rounds"), Pick("errors returned to clients"), Pick("wrong pages"),
        Pick("hits"), Pick("every page a hit again"))),
    "fastpath-sweep": _figures(_SWEEP_RECORD, _SWEEP),
    "fastpath-sweep-one-cpu": _figures(_SWEEP_ONE_CPU_RECORD, _SWEEP),
    "fastpath-sweep-cubic": _figures(_SWEEP_CUBIC_RECORD, (
        *(Pick(f"{size} {n}", ("get fast/raw",))
          for size, n in [("64 KiB", 8), ("64 KiB", 32), ("1 MiB", 1), ("1 MiB", 8)]),
        Pick("get of one 1 MiB page", ("fast p50 us", "raw p50 us")),
        Pick("1 x 1 MiB", ("fast: server", "fast: client", "raw: peer", "raw: client")))),
    "fastpath-split": _figures("fastpath-e623177c0a", _SPLIT, ("fastpath-4cc547bfe8", _SPLIT)),
    "fastpath-floor": _figures("fastpath-0f925144f7", tuple(
        Pick(call, ("our client", "our server", "the two on each other", "KVStoreClient's own",
                    "store / raw"))
        for call in ("lookup of 16 keys", "get 1 x 64 KiB", "get 8 x 64 KiB"))),
    "peers": _figures("peers-67ef7875a8", tuple(
        Pick(name, ("64 KiB", "1 MiB", "4 MiB")) for name in ("raw", "redis RESP", "lmcache"))),
    "fastpath-small-calls": _figures("fastpath-713bcc3c98", (
        Pick("acquire+release 1 page p50 us", ("fast unix", "grpc")),
        Pick("lookup 16 keys p50 us", ("fast", "fast unix", "grpc", "raw")),
        Pick("one 64 KiB page p50 us", ("fast", "raw")))),
    "fastpath-iperf": _figures("fastpath-713bcc3c98", (
        Pick("get 1 MiB pages GB/s", ("fast", "grpc", "raw", "iperf3")),
        Pick("get vs iperf3", ("median",)), Pick("gRPC x 2.5 vs iperf3", ("median",)))),
    "fastpath-netns": _figures("fastpath-netns-8c625dd33e", (
        Pick("get 1 MiB pages, 1 connection, GB/s", ("fast path", "raw socket", "fast / raw")),
        Pick("get 1 MiB pages, 4 connections, GB/s", ("fast path", "raw socket")),
        Pick("striped get over 4 connections / one connection"),
        Pick("put 1 MiB pages, 1 connection, GB/s", ("fast path", "raw socket")),
        Pick("one 64 KiB page p50 us", ("fast path", "raw socket", "gRPC")))),
    "remote-load": _figures("remote-load-cb31147405", (
        *(Pick(t, ("pages", "connections", "connector GB/s", "raw GB/s", "connector/raw"))
          for t in ("256", "1024", "4096")),
        Pick("load average"))),
    "fastpath-vs-grpc": _figures("fastpath-713bcc3c98", (
        Pick("get 1 MiB pages GB/s", ("fast", "grpc", "raw")),
        Pick("one 64 KiB page p50 us", ("fast", "grpc", "raw")))),
}


def fill(text: str, records: Sequence[Record]) -> str:
    """text with every block rendered from the records (Stale if one cannot be)."""
    by_name = {r.file_name().removesuffix(".json"): r for r in records}

    def render(m: re.Match[str]) -> str:
        view = VIEWS.get(m["name"])
        if view is None:
            raise Stale(f"no view named {m['name']!r} (bench/report_blocks.py: VIEWS)")
        return m.group(1) + view(by_name) + m.group(4)
    return _BLOCK.sub(render, text)


def stale_blocks(text: str, records: Sequence[Record]) -> list[str]:
    """The names of the blocks in text that differ from what the records render."""
    fresh = {m["name"]: m["body"] for m in _BLOCK.finditer(fill(text, records))}
    return [m["name"] for m in _BLOCK.finditer(text) if fresh.get(m["name"]) != m["body"]]
