"""One meaning of "the store is not answering" (connector.breaker.not_answering) for the
scheduler half and the worker half, against a real kvstore-server that refuses the
connector's token: both open their breakers at the first call that meets it, so neither
asks the store again until a probe finds it answering."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore_client import PageLayout  # noqa: E402
from kvstore_connector.config import ConnectorConfig, LookupMode  # noqa: E402
from kvstore_connector.meta import LoadSpec, StepMeta  # noqa: E402
from kvstore_connector.scheduler import SchedulerHalf  # noqa: E402
from kvstore_connector.worker import WorkerHalf  # noqa: E402

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 2, 8, 16, 2, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAYOUT = PageLayout(model="answering", num_layers=LAYERS, page_tokens=BLOCK,
                    num_kv_heads=HEADS, head_size=HEAD, dtype="float32")


@pytest.fixture
def srv(fresh_server, tmp_path):
    auth = tmp_path / "auth.toml"
    digest = hashlib.sha256(b"tok-known").hexdigest()
    auth.write_text(f'[tenants.engine]\ntoken_sha256 = "{digest}"\nshared_memory = true\n')
    return fresh_server(dram="64MiB", auth_file=str(auth))


def config(srv, token: str) -> ConnectorConfig:
    # A long probe interval: the breaker stays open for the whole test once opened.
    return ConnectorConfig(server=srv.address, token=token, probe_interval=60.0,
                           lookups=LookupMode.SYNC, lookup_timeout=5.0)


def test_an_unknown_token_opens_the_scheduler_halfs_breaker(srv):
    sched = SchedulerHalf(config(srv, "tok-unknown"), [LAYOUT], BLOCK)
    try:
        tokens = np.arange(64, dtype=np.int32)
        assert sched.hit("a", tokens, 0) == 0           # no hit, not a failed request
        assert sched.breaker.open
        assert sched.build().store_down                 # the workers make no call either
    finally:
        sched.close()


def test_an_unknown_token_opens_the_worker_halfs_breaker(srv):
    """The worker half's first call (here a load's) meets UNAUTHENTICATED: the load
    fails (the engine recomputes it) and the breaker opens, as the scheduler half's
    does, so the next step's calls are not made."""
    caches = {n: torch.zeros((2, BLOCKS, BLOCK, HEADS, HEAD)) for n in NAMES}
    worker = WorkerHalf(config(srv, "tok-unknown"), LAYOUT, caches)
    try:
        load = LoadSpec("a", (b"k" * 16,), np.array([[3]], dtype=np.int64), is_async=False)
        worker.bind(StepMeta(loads=(load,)))
        worker.start_load(StepMeta(loads=(load,)))
        worker.wait_for_save()
        assert worker.load_errors() == {3}
        assert worker.breaker.open
    finally:
        worker.close()


def test_a_known_token_leaves_both_breakers_closed(srv):
    """The same calls with the token the store knows: a miss is an answer."""
    sched = SchedulerHalf(config(srv, "tok-known"), [LAYOUT], BLOCK)
    try:
        assert sched.hit("a", np.arange(64, dtype=np.int32), 0) == 0
        assert not sched.breaker.open
    finally:
        sched.close()
