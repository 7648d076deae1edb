"""The command lines in deploy/ run against a real server: entrypoint, health check, probes,
the metrics forwarder and the engines' connector settings.

Each command is read from its file. Only what cannot be the same on a test machine is
mapped: container paths to temporary folders, and the fixed ports (50051, 9464, 9465) to
free ones, since other servers may hold them here.
"""

from __future__ import annotations

import grp
import hashlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector.config import ConnectorConfig, open_client
from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.errors import KVStoreError
from kvstore_testing.serverproc import free_port

from .deployfiles import (
    DEPLOY,
    CommandServer,
    container,
    dockerfile,
    exec_form,
    expand_compose,
    expand_k8s,
    final_stage,
    healthcheck_command,
    k8s_object,
    load_yaml_docs,
    remap_toml,
    run,
    tomllib,
    with_port,
)

# The server's own group on this machine stands in for the image's `kvstore` group.
MY_GROUP = grp.getgrgid(os.getgid()).gr_name
LAYOUT = PageLayout(model="deploy-test", num_layers=2, page_tokens=4, num_kv_heads=2,
                    head_size=16)


def _entrypoint() -> list[str]:
    return exec_form(next(rest for word, rest in final_stage(dockerfile())
                          if word == "ENTRYPOINT"))


def _compose() -> dict:
    return load_yaml_docs(DEPLOY / "compose/compose.yaml")[0]


def _scrape(port: int) -> set[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return {s.name for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def _forwarder(argv: list[str], listen: int, metrics_port: int) -> subprocess.Popen:
    """The socat line from a file, on this test's ports; skipped where socat is missing."""
    if not shutil.which("socat"):
        pytest.skip("socat is not installed here (apt-get install socat); the image has it")
    argv = [a.replace("TCP-LISTEN:9465", f"TCP-LISTEN:{listen}")
             .replace("127.0.0.1:9464", f"127.0.0.1:{metrics_port}") for a in argv]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            _scrape(listen)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"{argv} did not forward /metrics")


# -- compose: the image's entrypoint with compose's command and config ---------------
def _start_compose_server(disk) -> CommandServer:
    """kvstore-server as compose starts it: ENTRYPOINT + `command`, the mounted TOML,
    `environment` (with compose's defaults); the disk volume at `disk`."""
    svc = _compose()["services"]["kvstore"]
    here = DEPLOY / "compose"
    mounts = {v.split(":")[1]: (here / v.split(":")[0]).resolve()
              for v in svc["volumes"] if v.startswith(".")}
    argv = _entrypoint() + [str(mounts.get(a, a)) for a in svc["command"]]
    port, metrics = free_port(), free_port()
    env = {k: expand_compose(str(v), {}) for k, v in svc["environment"].items()}
    env.update(KVSTORE_DRAM="64MiB",                 # not 1 GiB on a shared CI machine
               KVSTORE_LISTEN=f"127.0.0.1:{port}", KVSTORE_DISK_DIR=str(disk),
               KVSTORE_METRICS_PORT=str(metrics), KVSTORE_SHM_GROUP=MY_GROUP)
    srv = CommandServer(argv, f"127.0.0.1:{port}", {**os.environ, **env})
    srv.metrics_port = metrics
    return srv.start()


@pytest.fixture(scope="module")
def compose_server(tmp_path_factory):
    with _start_compose_server(tmp_path_factory.mktemp("compose-disk")) as srv:
        yield srv


def test_image_healthcheck_says_serving(compose_server):
    argv = with_port(healthcheck_command(final_stage(dockerfile())), "127.0.0.1:50051",
                     compose_server.address)
    result = run(argv)
    assert result.returncode == 0 and result.stdout.strip() == "SERVING", result


def test_compose_metrics_forwarder(compose_server):
    svc = _compose()["services"]["metrics"]
    assert svc["network_mode"] == "service:kvstore"     # so 127.0.0.1 is kvstore's
    listen = free_port()
    proc = _forwarder(svc["entrypoint"], listen, compose_server.metrics_port)
    try:
        assert "kvstore_capacity_bytes" in _scrape(listen)
    finally:
        proc.kill()
        proc.wait()


def test_compose_stop_flushes_and_restart_is_warm(tmp_path):
    """SIGTERM within stop_grace_period writes DRAM to the disk volume; the next server on
    that volume serves the pages: the upgrade path of deploy/README.md."""
    keys = [b"warm-%011d" % i for i in range(16)]
    first = _start_compose_server(tmp_path)
    try:
        with KVStoreClient(first.address) as c:
            ns = c.register_layout(LAYOUT)
            pages = np.random.default_rng(1).integers(0, 255, (16, ns.page_bytes),
                                                      dtype=np.uint8)
            c.put(ns, keys, pages)
        grace = float(_compose()["services"]["kvstore"]["stop_grace_period"].rstrip("s"))
        start = time.monotonic()
        assert first.stop(signal.SIGTERM, timeout=grace) == 0
        assert time.monotonic() - start < grace
        assert "flushed DRAM to disk: 16 pages offered, 0 not written" in first.log()
    finally:
        first.stop()
    with _start_compose_server(tmp_path) as again:
        with KVStoreClient(again.address) as c:
            ns = c.register_layout(LAYOUT)
            assert c.lookup(ns, keys) == 16
            assert np.array_equal(c.get(ns, keys), pages)


# -- Kubernetes: the DaemonSet's container with the ConfigMap and Secret -------------
@pytest.fixture(scope="module")
def k8s_server(tmp_path_factory):
    """The DaemonSet's kvstore container: its args, the ConfigMap's TOML and the Secret's
    auth file (its placeholder digests replaced by this test's tokens, as the README says),
    each volume at a temporary folder."""
    spec = k8s_object("DaemonSet", "kvstore")["spec"]["template"]["spec"]
    c = container(spec, "kvstore")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {}
    for m in c["volumeMounts"]:
        folder = tmp_path_factory.mktemp(m["name"])
        vol = volumes[m["name"]]
        if "configMap" in vol:
            data = k8s_object("ConfigMap", vol["configMap"]["name"])["data"]
        elif "secret" in vol:
            data = k8s_object("Secret", vol["secret"]["secretName"])["stringData"]
        else:
            data = {}
        mounts[m["mountPath"]] = folder
        for name, text in data.items():
            (folder / name).write_text(text)
    tokens = {"tenants": secrets.token_hex(16), "admins": secrets.token_hex(16)}
    for folder in mounts.values():
        for f in folder.glob("*.toml"):
            text = remap_toml(f.read_text(), mounts)
            table = tomllib.loads(text)
            for section, token in tokens.items():
                for entry in table.get(section, {}).values():
                    text = text.replace(entry["token_sha256"],
                                        hashlib.sha256(token.encode()).hexdigest())
            f.write_text(text)
    args = [str(mounts[os.path.dirname(a)] / os.path.basename(a))
            if os.path.dirname(a) in mounts else a for a in c["args"]]
    port, metrics = free_port(), free_port()
    env = {**os.environ, "KVSTORE_DRAM": "64MiB", "KVSTORE_DISK": "64MiB",
           "KVSTORE_LISTEN": f"127.0.0.1:{port}", "KVSTORE_METRICS_PORT": str(metrics),
           "KVSTORE_SHM_GROUP": MY_GROUP}
    srv = CommandServer(_entrypoint() + args, f"127.0.0.1:{port}", env)
    srv.metrics_port, srv.tokens, srv.container = metrics, tokens, c
    with srv.start():
        yield srv


def test_k8s_server_runs_with_auth_from_the_secret(k8s_server):
    assert "auth: 1 tenants, 1 admins" in k8s_server.log(), k8s_server.log()


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_k8s_probes(k8s_server, probe):
    argv = with_port(k8s_server.container[probe]["exec"]["command"], "127.0.0.1:50051",
                     k8s_server.address)
    result = run(argv, timeout=k8s_server.container[probe]["timeoutSeconds"] + 10)
    assert result.returncode == 0 and result.stdout.strip() == "SERVING", result


def test_k8s_probe_fails_when_nothing_listens():
    c = container(k8s_object("DaemonSet", "kvstore")["spec"]["template"]["spec"], "kvstore")
    argv = with_port(c["livenessProbe"]["exec"]["command"], "127.0.0.1:50051",
                     f"127.0.0.1:{free_port()}")
    assert run(argv).returncode != 0


def test_k8s_metrics_container(k8s_server):
    spec = k8s_object("DaemonSet", "kvstore")["spec"]["template"]["spec"]
    argv = [expand_k8s(a, {"NODE_IP": "127.0.0.1"}) for a in container(spec, "metrics")["command"]]
    listen = free_port()
    proc = _forwarder(argv, listen, k8s_server.metrics_port)
    try:
        assert "kvstore_rpc_duration_seconds_bucket" in _scrape(listen) or \
            "kvstore_capacity_bytes" in _scrape(listen)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_k8s_engine_reaches_the_node_store(k8s_server, engine):
    """The engine Deployment's connector JSON, with $(NODE_IP) and $(KVSTORE_TOKEN) as
    Kubernetes expands them, stores and finds pages through shared memory."""
    args = k8s_object("Deployment", engine)["spec"]["template"]["spec"]["containers"][0]["args"]
    raw = next(v for f, v in itertools.pairwise(args) if f in (
        "--kv-transfer-config", "--hicache-storage-backend-extra-config"))
    text = expand_k8s(raw, {"NODE_IP": "127.0.0.1", "KVSTORE_TOKEN": k8s_server.tokens["tenants"]})
    cfg = json.loads(with_port([text], "127.0.0.1:50051", k8s_server.address)[0])
    cfg = cfg.get("kv_connector_extra_config", cfg)
    ours = {k: v for k, v in cfg.items()
            if k not in ("backend_name", "module_path", "class_name", "interface_v1")}
    settings = ConnectorConfig.from_mapping(ours)
    keys = [f"{engine}-{i:010d}".encode() for i in range(4)]
    with open_client(settings, settings.timeout, shared_memory=True) as client:
        ns = client.register_layout(LAYOUT)
        client.put(ns, keys, np.full((4, ns.page_bytes), 3, dtype=np.uint8))
        assert client.lookup(ns, keys) == 4
        assert (client.get(ns, keys) == 3).all()
    # The wrong token is refused: auth is really on.
    bad = ConnectorConfig.from_mapping({**ours, "token": "not-the-token"})
    with open_client(bad, 5, retries=0, shared_memory=False) as client:
        with pytest.raises(KVStoreError) as info:
            client.register_layout(LAYOUT)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_k8s_init_container_hands_the_folders_to_the_store(tmp_path):
    """prepare-dirs' command on temporary folders: owner 10001, the pool folder 0750 (group
    may enter, to open the 0660 pool file), the disk folder 0700."""
    if os.geteuid() != 0:
        pytest.skip("chown to uid 10001 needs root")
    spec = k8s_object("DaemonSet", "kvstore")["spec"]["template"]["spec"]
    init = container(spec, "prepare-dirs")
    argv = init["command"]
    modes = {}
    for m in init["volumeMounts"]:
        folder = tmp_path / m["name"]
        folder.mkdir()
        argv = [a.replace(m["mountPath"], str(folder)) for a in argv]
        modes[m["name"]] = folder
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for name, mode in (("pool", 0o750), ("disk", 0o700)):
        st = os.stat(modes[name])
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (10001, 10001, mode), name
