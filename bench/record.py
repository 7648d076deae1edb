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
                                                      # blocks (report.py, report_blocks.py)

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

__all__ = ["DEFAULT_DIR", "Record", "load_records", "machine", "run_recorded"]

DEFAULT_DIR = os.path.join("docs", "perf")


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
