"""Pages bound to the weights' revision, under vLLM 0.33's real scheduler with a real
kvstore-server: two engines of one model name share pages only when their revisions
agree, whether the revision is set in the connector config, taken from vLLM's model
config, or fingerprinted from the weights' folder; and `invalidate --model --revision`
removes exactly what the connector wrote."""

from __future__ import annotations

import json
import shutil
import struct

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
    write_model_dir,
)
from vllm.v1.request import RequestStatus

from kvstore_client import KVStoreClient

SHAPE = ModelShape()
PROMPT = list(range(2000, 2064))     # 64 tokens: 4 pages saved, a hit of 3 (48 tokens)
NAME = "opt-tiny"                    # one model name for every engine here


def engine(model_dir, address, *, engine_revision=None, **extra):
    spec = ConnectorSpec(name="KVStoreConnector", module_path="kvstore_connector.vllm",
                         extra_config={"server": address, "load_mode": "async",
                                       "lookup_timeout": 5.0, "lookup_wait_ms": 5000,
                                       "model": NAME, **extra},
                         load_failure_policy="recompute")
    config = make_vllm_config(model_dir, spec)
    config.model_config.revision = engine_revision      # as `vllm serve --revision`
    kv_cache_config = make_kv_cache_config(config)
    return SchedulerDriver(make_scheduler(config, kv_cache_config),
                           WorkerDriver(config, kv_cache_config, SHAPE))


def run(driver, req_id, max_steps=20):
    for _ in range(max_steps):
        if req_id not in driver.scheduler.requests:
            return
        driver.step()
    raise AssertionError(f"{req_id} did not finish in {max_steps} steps")


def hit(driver, req_id):
    """Tokens the store gave a new request: what the first step admits it with."""
    driver.add(make_request(req_id, PROMPT, max_tokens=2))
    driver.step()
    status = driver.status(req_id)
    tokens = driver.request(req_id).num_computed_tokens
    run(driver, req_id)
    return tokens if status == RequestStatus.WAITING_FOR_REMOTE_KVS else 0


def revisions(address):
    """{revision: pages} of the store's layouts of NAME."""
    with KVStoreClient(address) as c:
        return {s.layout.revision: s.pages for s in c.list_layouts()
                if s.layout.model == NAME}


def write_weights(folder, data: bytes):
    """A one-tensor safetensors file: its header, then the tensor's bytes."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(data)],
                               "data_offsets": [0, len(data)]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.fixture
def store(fresh_server):
    return fresh_server(dram="64MiB")


def test_revisions_set_in_the_config_never_share_pages(model_dir, store):
    first = engine(model_dir, store.address, model_revision="step-100")
    assert hit(first, "a") == 0
    other = engine(model_dir, store.address, model_revision="step-200")
    assert hit(other, "b") == 0                 # the same tokens, other weights: no hit
    same = engine(model_dir, store.address, model_revision="step-100")
    assert hit(same, "c") == 48                 # the same weights: a hit
    assert revisions(store.address) == {"step-100": 4, "step-200": 4}


def test_the_engines_revision_scopes_pages_and_the_config_overrides_it(model_dir, store):
    assert hit(engine(model_dir, store.address, engine_revision="abc123"), "a") == 0
    assert hit(engine(model_dir, store.address, engine_revision="def456"), "b") == 0
    assert hit(engine(model_dir, store.address, engine_revision="abc123"), "c") == 48
    # model_revision wins over vLLM's: these pages are step-7's, not def456's.
    assert hit(engine(model_dir, store.address, engine_revision="def456",
                      model_revision="step-7"), "d") == 0
    assert revisions(store.address) == {"abc123": 4, "def456": 4, "step-7": 4}


def test_a_weights_folder_is_fingerprinted_by_content_not_by_path(tmp_path, store):
    """Two copies of one checkpoint share pages wherever they lie; new weights in the same
    shapes (an RL step: same config, same headers) do not."""
    weights = bytes(range(256)) * 64
    copies = []
    for name in ("host-a", "host-b"):
        folder = write_model_dir(tmp_path / name, SHAPE)
        write_weights(folder, weights)
        copies.append(folder)
    stepped = tmp_path / "host-a-next"
    shutil.copytree(copies[0], stepped)
    write_weights(stepped, weights[:-1] + b"\x00")      # one byte of the weights changed

    assert hit(engine(copies[0], store.address), "a") == 0
    assert hit(engine(copies[1], store.address), "b") == 48
    assert hit(engine(stepped, store.address), "c") == 0
    found = revisions(store.address)
    assert len(found) == 2 and all(r.startswith("fp-") for r in found)


def test_invalidate_by_model_and_revision_removes_what_the_connector_wrote(model_dir, store):
    hit(engine(model_dir, store.address, model_revision="step-100"), "a")
    hit(engine(model_dir, store.address, model_revision="step-200"), "b")
    with KVStoreClient(store.address) as c:
        out = c.admin.invalidate(model=NAME, revision="step-100")
    assert out.dram_pages == 4
    assert revisions(store.address).get("step-200") == 4
    assert revisions(store.address).get("step-100", 0) == 0
    assert hit(engine(model_dir, store.address, model_revision="step-100"), "c") == 0
    assert hit(engine(model_dir, store.address, model_revision="step-200"), "d") == 48
