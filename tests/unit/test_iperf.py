"""bench/iperf.py: iperf3's loopback stream, the fast-path bench's ceiling column."""

from __future__ import annotations

import shutil

import pytest

from kvstore_bench.iperf import iperf3_gbps


def test_no_figure_without_iperf3(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))        # a folder with no iperf3 in it
    assert iperf3_gbps(1) is None


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 is not installed")
def test_one_stream_over_loopback_moves_bytes():
    gbps = iperf3_gbps(1)
    # Any machine's loopback carries more than 10 MB/s and less than 1 TB/s.
    assert gbps is not None and 0.01 < gbps < 1000
