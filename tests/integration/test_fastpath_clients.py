"""`kvstore-bench fastpath --client-ab DIR --quick`: another checkout's client (here this
one's own, loaded a second time under another name) against this one, alternated blocks
against one server. No figure is asserted, only the shape of the report."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

import kvstore_client
from kvstore_bench import fastpath_bench

pytestmark = pytest.mark.slow

NUMBER = r"\d+(\.\d+)?"


def test_quick_client_ab_prints_a_ratio_for_every_pattern():
    out = io.StringIO()
    folder = os.path.dirname(kvstore_client.__file__)
    with contextlib.redirect_stdout(out):
        assert fastpath_bench.main(["--client-ab", folder, "--quick"]) == 0
    text = out.getvalue()
    rows = [line.strip("|").split("|") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| pattern", "| floor"))]
    patterns = {r[0].strip(): r for r in rows if len(r) == 7}
    assert {"get 64 KiB x1", "put 64 KiB x1", "lookup of 16 keys",
            "leased lookup + release later"} <= set(patterns), text
    for row in patterns.values():
        assert all(re.fullmatch(NUMBER, cell.strip()) for cell in row[1:4]), row
        assert re.fullmatch(r"\d+/2", row[4].strip()), row
    assert {r[0].strip() for r in rows if len(r) == 3} == {
        "raw get 64 KiB", "raw round trip, 16 bytes"}, text


def test_a_folder_without_a_client_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no kvstore_client package"):
        fastpath_bench.main(["--client-ab", str(tmp_path), "--quick"])
