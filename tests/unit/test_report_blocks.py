"""Figures in the README and docs/ are blocks `kvstore-bench report` renders from the
records in docs/perf/ (bench/report_blocks.py): the checked-in blocks are what the records
render, a block edited by hand reads as stale, and a view picks what its record printed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvstore_bench.record import Record, load_records
from kvstore_bench.report_blocks import DOCS, Pick, Stale, _pick, fill, stale_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = shutil.which("kvstore-bench", path=os.path.dirname(sys.executable)) or "kvstore-bench"

OUTPUT = """medians of 3

| | fast | raw |
|---|---|---|
| get GB/s | 4.70 | 3.59 |
| one page p50 us | 110 | 72 |

get: fast / raw = 1.3x; more words
"""


def _record(output: str = OUTPUT) -> Record:
    return Record("fastpath", ["--runs", "3"], "2 cores (AMD EPYC), 24 GiB, no GPU",
                  "2026-12-01T10:00Z", 10.0, (1.0, 1.0), 0, output)


def test_the_figure_blocks_are_current_with_their_records():
    out = subprocess.run([BENCH, "report", "--check", "--records",
                          os.path.join(ROOT, "docs", "perf"), "--out",
                          os.path.join(ROOT, "docs", "performance.md"), "--docs", ROOT],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr


def test_the_readme_headlines_are_a_block():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "<!-- kvstore-bench report: headlines -->\n| what |" in f.read()


def test_a_block_edited_by_hand_is_stale_and_report_rewrites_it():
    records = load_records(os.path.join(ROOT, "docs", "perf"))
    with open(os.path.join(ROOT, DOCS[0])) as f:
        text = f.read()
    edited = text.replace("| H200 |", "| H100 |", 1)
    assert edited != text
    assert stale_blocks(edited, records) == ["headlines"]
    assert fill(edited, records) == text


def test_a_pick_shows_a_row_by_its_columns_or_a_line_by_its_start():
    r = _record()
    assert _pick(r, Pick("get GB/s", ("fast", "raw"))) == "get GB/s: fast 4.70, raw 3.59"
    assert _pick(r, Pick("one page p50 us", ("raw",))) == "one page p50 us: raw 72"
    assert _pick(r, Pick("get: fast", cut=";")) == "get: fast / raw = 1.3x"


@pytest.mark.parametrize("pick", [Pick("put GB/s", ("fast",)), Pick("get GB/s", ("grpc",)),
                                  Pick("put:")])
def test_a_figure_the_record_does_not_hold_is_an_error(pick):
    with pytest.raises(Stale):
        _pick(_record(), pick)


def test_a_block_that_names_no_view_is_an_error():
    with pytest.raises(Stale, match="no view named 'nothing'"):
        fill("<!-- kvstore-bench report: nothing -->\nx\n<!-- end -->\n", [])
