"""Benchmark records: what one run printed, with the machine, date and command, kept as JSON
under docs/perf/ and rendered into docs/performance.md by `kvstore-bench report`.

Figures in the documentation come from here and nowhere else, so each one can be traced to
the command that printed it and the machine it ran on. A record holds the bench's own output
verbatim (its medians and same-run ratios are the bench's job), and how loaded the machine
was while it ran: the 2-core machines are shared, and a figure from a loaded one reads
differently from a quiet one.

    kvstore-bench --record docs/perf shm --reps 5     # runs shm, prints as usual, records
    kvstore-bench report                              # docs/perf/*.json -> docs/performance.md
                                                      # and the README's and docs/' figure
                                                      # blocks (report_blocks.py)

One record per (bench, machine, arguments): a later run of the same command on the same kind
of machine replaces the earlier one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable

__all__ = ["Record", "machine", "main", "render", "run_recorded"]

DEFAULT_DIR = os.path.join("docs", "perf")
DEFAULT_OUT = os.path.join("docs", "performance.md")


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    bench: str
    argv: list[str]         # the bench's own arguments
    machine: str            # "16 cores (AMD EPYC ...), 128 GiB, 1x NVIDIA H200"
    date: str               # UTC, ISO 8601, to the minute
    seconds: float          # how long the run took
    load: tuple[float, float]   # 1-minute load average when it started and when it ended
    rc: int
    output: str             # what it printed on stdout

    @property
    def command(self) -> str:
        return " ".join(["kvstore-bench", self.bench, *self.argv])

    def file_name(self) -> str:
        digest = hashlib.sha1("\0".join([self.bench, self.machine, *self.argv]).encode())
        return f"{self.bench}-{digest.hexdigest()[:10]}.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        names = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return ""
    names = [n.strip() for n in names if n.strip()]
    return f"{len(names)}x {names[0]}" if names else ""


def machine() -> str:
    """What the figures ran on, in words: cores, CPU model, memory, GPUs. No host names."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    parts = [f"{os.cpu_count()} cores ({_cpu_model()})", f"{round(mem / 2**30)} GiB"]
    gpus = _gpus()
    parts.append(gpus or "no GPU")
    return ", ".join(parts)


class _Tee(io.TextIOBase):
    """stdout that also keeps what was written."""

    def __init__(self, out) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def _local_paths_out(text: str) -> str:
    """Records are committed: the folder a bench ran in reads as ".", so no path of the
    machine it ran on goes into the repository."""
    here = os.getcwd().rstrip("/")
    return text.replace(here + "/", "./").replace(here, ".") if here else text


def _argv_out(argv: list[str]) -> list[str]:
    """The command as recorded: a path under the folder it ran in reads relative to it,
    any other absolute path as DIR (an output folder of that machine)."""
    here = os.getcwd().rstrip("/") + "/"
    return [a[len(here):] if a.startswith(here) else "DIR" if os.path.isabs(a) else a
            for a in argv]


def run_recorded(folder: str, bench: str, argv: list[str],
                 run: Callable[[list[str]], int]) -> int:
    """Run a bench with its stdout kept; write the record when it succeeds."""
    load0 = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.timezone.utc)
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        rc = run(argv)
    rc = 0 if rc is None else rc
    if rc != 0:
        print(f"kvstore-bench: {bench} exited {rc}: nothing recorded", file=sys.stderr)
        return rc
    took = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    record = Record(bench, _argv_out(list(argv)), machine(), started.strftime("%Y-%m-%dT%H:%MZ"),
                    round(took, 1), (round(load0, 2), round(os.getloadavg()[0], 2)), rc,
                    _local_paths_out(tee.kept.getvalue()))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, record.file_name())
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(record), f, indent=1)
        f.write("\n")
    print(f"kvstore-bench: recorded in {path}", file=sys.stderr)
    return 0


def load_records(folder: str) -> list[Record]:
    records = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                raw = json.load(f)
            raw["load"] = tuple(raw["load"])
            records.append(Record(**raw))
    return records


def render(records: list[Record]) -> str:
    """docs/performance.md: every record, grouped by bench, newest first within a bench."""
    lines = ["# Performance", "",
             ("Generated by `kvstore-bench report` from the records in `docs/perf/` "
             "(`kvstore-bench --record docs/perf NAME ...`); do not edit by hand. Each section "
             "is one run: the command, the machine, when, how loaded the machine was (1-minute "
             "load average at the start and the end), and what the bench printed. Ratios are "
             "measured side by side in that run; medians are over the repetitions the bench "
             "names."), ""]
    by_bench: dict[str, list[Record]] = {}
    for r in records:
        by_bench.setdefault(r.bench, []).append(r)
    for bench in sorted(by_bench):
        lines += [f"## {bench}", ""]
        for r in sorted(by_bench[bench], key=lambda r: r.date, reverse=True):
            lines += [f"`{r.command}`", "",
                      f"- machine: {r.machine}",
                      (f"- date: {r.date}, {r.seconds:.0f} s; load average "
                       f"{r.load[0]:.1f} -> {r.load[1]:.1f}"), ""]
            out = r.output.rstrip("\n")
            markdown = any(line.startswith(("|-", "|:"))
                           for line in out.splitlines())
            lines += [out, ""] if markdown else ["```", out, "```", ""]
    return "\n".join(lines)


def _documents(root: str, records: list[Record], check: bool) -> list[str]:
    """Fill the figure blocks of the documents under root (report_blocks.DOCS) from the
    records; with check, only name the ones that are stale."""
    from .report_blocks import DOCS, fill, stale_blocks

    stale = []
    for name in DOCS:
        path = os.path.join(root, name)
        with open(path) as f:
            text = f.read()
        if check:
            stale += [f"{name} ({block})" for block in stale_blocks(text, records)]
            continue
        fresh = fill(text, records)
        if fresh != text:
            with open(path, "w") as f:
                f.write(fresh)
            print(f"wrote the figures in {name}")
    return stale


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="kvstore-bench report",
                                description="Render the benchmark records into one document, "
                                            "and the figure blocks of the README and docs/.")
    p.add_argument("--records", default=DEFAULT_DIR, help=f"default {DEFAULT_DIR}")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}; - = stdout")
    p.add_argument("--docs", metavar="ROOT", default=None,
                   help="the repository root whose README and docs/ hold figure blocks "
                        "(bench/report_blocks.py); default . with the default --records, "
                        "else none")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if --out or a figure block differs from what the records "
                        "render")
    args = p.parse_args(argv)
    records = load_records(args.records)
    text = render(records)
    docs = args.docs if args.docs is not None else "." if args.records == DEFAULT_DIR else ""
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    if args.check:
        try:
            with open(args.out) as f:
                same = f.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            print(f"{args.out} is not what `kvstore-bench report` renders from "
                  f"{args.records}: run it", file=sys.stderr)
        stale = _documents(docs, records, check=True) if docs else []
        if stale:
            print(f"figure blocks not what `kvstore-bench report` renders from "
                  f"{args.records}: {', '.join(stale)}: run it", file=sys.stderr)
        return 0 if same and not stale else 1
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} from {len(records)} records")
    if docs:
        _documents(docs, records, check=False)
    return 0
