"""Session retention asked through vLLM's kv_transfer_params (connector.scheduler.retention), under
vLLM 0.33's real scheduler with a real kvstore-server: the retained prefix outlives another
tenant's eviction pressure while a prefix saved beside it does not; a refusal past the
quota, and a malformed ask, still serve the request and are counted; release ends it.
What the server holds is read from /metrics, as an operator reads it."""

from __future__ import annotations

import hashlib
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (scripts/venv-vllm.sh)")

from harness import (
    ConnectorSpec,
    ModelShape,
    SchedulerDriver,
    WorkerDriver,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.request import RequestStatus

from kvstore_client import KVStoreClient, PageLayout
from kvstore_testing.serverproc import free_port

SHAPE = ModelShape()
KEPT = list(range(3000, 3064))       # 64 tokens: 4 pages of 16 KiB saved
OTHER = list(range(5000, 5064))      # saved beside it, not retained
TOKENS = {"a": "tok-vllm-retain-a", "b": "tok-vllm-retain-b"}
# Pages of the engine's size (16 KiB): the pool evicts within a page size's slots.
PRESSURE = PageLayout(model="pressure", num_layers=2, page_tokens=16, num_kv_heads=4,
                      head_size=16, dtype="float32")


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def server(fresh_server, tmp_path, **flags):
    path = tmp_path / "auth.toml"
    path.write_text("".join(f'[tenants.{name}]\ntoken_sha256 = "{sha(token)}"\n\n'
                            for name, token in TOKENS.items()))
    port = free_port()
    srv = fresh_server(dram="16MiB", auth_file=str(path), metrics_port=port, **flags)
    srv.metrics_port = port
    return srv


def metric(srv, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def engine(model_dir, srv):
    spec = ConnectorSpec(name="KVStoreConnector", module_path="kvstore_connector.vllm",
                         extra_config={"server": srv.address, "token": TOKENS["a"],
                                       "load_mode": "async", "lookup_timeout": 5.0,
                                       "lookup_wait_ms": 5000, "model_revision": "r1"},
                         load_failure_policy="recompute")
    config = make_vllm_config(model_dir, spec)
    kv_cache_config = make_kv_cache_config(config)
    return SchedulerDriver(make_scheduler(config, kv_cache_config),
                           WorkerDriver(config, kv_cache_config, SHAPE))


def connector(driver):
    """The scheduler-side connector vLLM's scheduler built."""
    return driver.scheduler.connector


def serve(driver, req_id, prompt, params=None, max_steps=500):
    """Run one request to its end; the tokens the store gave it. (A tenant's pages move
    over gRPC, on the connector's own threads: a load may take some steps.)"""
    driver.add(make_request(req_id, prompt, max_tokens=2, kv_transfer_params=params))
    driver.step()
    hit = (driver.request(req_id).num_computed_tokens
           if driver.status(req_id) == RequestStatus.WAITING_FOR_REMOTE_KVS else 0)
    for _ in range(max_steps):
        if req_id not in driver.scheduler.requests:
            return hit
        driver.step()
        time.sleep(0.01)
    raise AssertionError(f"{req_id} did not finish: {driver.status(req_id)}")


def settle(driver, timeout=10.0):
    """Step until the connector has sent every ask it holds (saves land a step later)."""
    deadline = time.monotonic() + timeout
    c = connector(driver)
    while time.monotonic() < deadline:
        if not c._retain_after_save and c.retainer.idle():
            return c.retainer.counts
        driver.step()
        time.sleep(0.01)
    raise AssertionError(f"retention asks still pending: {c.retainer.counts}")


def pressure(srv, round_: str) -> None:
    """Tenant b fills the whole pool twice over."""
    with KVStoreClient(srv.address, token=TOKENS["b"], shared_memory=False,
                       data_plane=False, retries=0) as b:
        ns = b.register_layout(PRESSURE)
        n = 16 * (1 << 20) // ns.page_bytes
        rng = np.random.default_rng(7)
        for part in range(8):
            keys = [f"{round_}{part}-{i}".encode().ljust(16, b"_") for i in range(n // 4)]
            b.put(ns, keys, rng.integers(0, 256, (len(keys), ns.page_bytes), dtype=np.uint8))


def test_a_retained_prefix_outlives_another_tenants_pressure(model_dir, fresh_server,
                                                             tmp_path):
    srv = server(fresh_server, tmp_path)
    first = engine(model_dir, srv)
    ask = {"kvstore_retain": {"session": "agent-7", "ttl_s": 600}}
    assert serve(first, "kept", KEPT, ask) == 0
    assert serve(first, "other", OTHER) == 0
    counts = settle(first)
    assert (counts.retained, counts.pages, counts.refused) == (1, 4, 0)
    assert metric(srv, "kvstore_retained_pages") == 4
    assert metric(srv, "kvstore_retention_sessions") == 1

    pressure(srv, "p")
    later = engine(model_dir, srv)
    assert serve(later, "kept-again", KEPT) == 48      # the retained prefix: a hit
    assert serve(later, "other-again", OTHER) == 0     # the pressure was real

    # The session's last turn releases it.
    serve(later, "bye", KEPT, {"kvstore_retain": {"session": "agent-7", "release": True}})
    assert settle(later).released == 1
    assert metric(srv, "kvstore_retained_pages") == 0
    assert metric(srv, "kvstore_retention_sessions") == 0


def test_a_refused_or_malformed_ask_still_serves_the_request_and_is_counted(
        model_dir, fresh_server, tmp_path):
    srv = server(fresh_server, tmp_path, retention_quota="32KiB")   # two 16 KiB pages
    driver = engine(model_dir, srv)
    assert serve(driver, "big", KEPT, {"kvstore_retain": {"session": "s", "ttl_s": 60}}) == 0
    assert serve(driver, "odd", OTHER, {"kvstore_retain": {"session": "s", "ttl_s": -1}}) == 0
    counts = settle(driver)
    assert (counts.asked, counts.refused, counts.retained, counts.malformed) == (1, 1, 0, 1)
    assert metric(srv, "kvstore_retention_refused_total") == 1
    assert metric(srv, "kvstore_retained_pages") == 0
    # Both were served, and their pages saved as any other's.
    again = engine(model_dir, srv)
    assert serve(again, "big-again", KEPT) == 48
    assert serve(again, "odd-again", OTHER) == 48
