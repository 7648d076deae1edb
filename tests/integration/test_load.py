"""A short load test (kvstore-bench load-test): four clients, both data planes, eviction
running, every byte checked; the 60 s run with 8 clients is in README.md."""

from kvstore_bench.load_test import LoadConfig, failed, page_of, report, run


def test_pages_are_made_from_their_keys():
    a, b = page_of(b"k" * 16, 4096), page_of(b"j" * 16, 4096)
    assert a.size == 4096 and (a == page_of(b"k" * 16, 4096)).all()
    assert (a != b).mean() > 0.99


def test_four_clients_for_five_seconds():
    r = run(LoadConfig(clients=4, seconds=5, warmup=2, dram="32MiB", keys=2048, page_kib=32))
    text = report(r)
    assert r["errors"] == 0 and r["mismatches"] == 0, text
    assert not failed(r), text
    assert r["paths"] == ["grpc", "grpc", "shm", "shm"], text
    assert r["pages_checked"] > 0 and r["server"]["evictions"] > 0, text
    assert all(r["rpcs"][rpc]["calls"] > 0 for rpc in ("put", "get", "lookup", "exists")), text
    assert r["rss"]["samples"], text
