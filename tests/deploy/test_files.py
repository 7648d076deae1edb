"""Every file in deploy/ parses, and the files agree with each other and with the server."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import pathlib
import re

import pytest

from connector.config import ConnectorConfig
from kvstore_protocol.units import parse_duration, parse_size
from kvstore_server.auth import parse_auth_file
from kvstore_server.config import load_config

from .deployfiles import (
    DEPLOY,
    K8S,
    container,
    dockerfile,
    final_stage,
    k8s_object,
    load_yaml_docs,
    tomllib,
)

YAML_FILES = sorted(p for ext in ("*.yaml", "*.yml") for p in DEPLOY.rglob(ext))
JSON_FILES = sorted(DEPLOY.rglob("*.json"))


def test_deploy_has_the_files_we_test():
    names = {p.relative_to(DEPLOY).as_posix() for p in YAML_FILES + JSON_FILES}
    assert {"compose/compose.yaml", "grafana/kvstore.json", "prometheus/alerts.yml",
            "k8s/base/daemonset.yaml"} <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path):
    assert load_yaml_docs(path), f"{path} holds no document"


@pytest.mark.parametrize("path", JSON_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_json_parses(path):
    json.loads(path.read_text())


def _configmap_toml() -> str:
    return k8s_object("ConfigMap", "kvstore-config")["data"]["kvstore.toml"]


@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_server_settings_load_with_the_real_loader(tmp_path, source):
    text = ((DEPLOY / "compose" / "kvstore.toml").read_text() if source == "compose"
            else _configmap_toml())
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    # The real loader and its checks (a non-loopback listen needs auth or insecure_listen).
    config = load_config(["--config", str(path)], environ={})
    assert config.metrics_port, "Prometheus scrapes these stores: metrics_port must be set"
    assert config.disk and config.flush_on_stop, "a restart should come back warm"


def test_k8s_auth_secret_parses_and_opens_nothing(tmp_path):
    text = k8s_object("Secret", "kvstore-auth")["stringData"]["auth.toml"]
    table = tomllib.loads(text)
    assert table["tenants"]["engines"]["shared_memory"] is True
    # The shipped digests are placeholders that match no token (all zeros, ...1).
    for section in ("tenants", "admins"):
        for entry in table[section].values():
            assert set(entry["token_sha256"].lstrip("0")) <= {"1"}
    path = tmp_path / "auth.toml"
    path.write_text(text)
    parse_auth_file(str(path))      # the server's own parser and checks


def _pool_bytes(dram: int) -> int:
    # As the server sizes its region (kvstore_server/main.py): 4 KiB header, 2 MiB rounding.
    return -(-(dram // 4096 * 4096 + 4096) // (2 << 20)) * (2 << 20)


def _quantity(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(q))
    assert m, f"unexpected quantity {q}"
    return int(m.group(1)) * units.get(m.group(2), 1)


def test_k8s_memory_is_sized_from_the_pool():
    dram = parse_size(tomllib.loads(_configmap_toml())["dram"])
    spec = k8s_object("DaemonSet", "kvstore")["spec"]["template"]["spec"]
    res = container(spec, "kvstore")["resources"]
    request, limit = _quantity(res["requests"]["memory"]), _quantity(res["limits"]["memory"])
    assert request == limit, "Guaranteed QoS: request == limit"
    assert request >= _pool_bytes(dram) + (1 << 30), "pool + at least 1 GiB for the rest"
    # The huge page overlay moves the pool to hugepages-2Mi.
    patch = load_yaml_docs(K8S / "overlays/hugepages/daemonset-hugepages.yaml")[0]
    hres = patch["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert _quantity(hres["requests"]["hugepages-2Mi"]) >= _pool_bytes(dram)
    assert hres["requests"]["hugepages-2Mi"] == hres["limits"]["hugepages-2Mi"]


def test_k8s_grace_covers_drain_and_flush():
    config = tomllib.loads(_configmap_toml())
    spec = k8s_object("DaemonSet", "kvstore")["spec"]["template"]["spec"]
    flush = parse_duration(config["flush_timeout"])
    assert spec["terminationGracePeriodSeconds"] >= 5 + flush + 10


def test_k8s_engines_mount_the_pool_where_the_store_keeps_it():
    store = k8s_object("DaemonSet", "kvstore")["spec"]["template"]["spec"]
    shm_dir = tomllib.loads(_configmap_toml())["shm_dir"]
    mount = next(m for m in container(store, "kvstore")["volumeMounts"]
                 if m["mountPath"] == shm_dir)
    host = next(v for v in store["volumes"] if v["name"] == mount["name"])["hostPath"]["path"]
    for name in ("vllm", "sglang"):
        spec = k8s_object("Deployment", name)["spec"]["template"]["spec"]
        vol = next(v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == host)
        mounts = spec["containers"][0]["volumeMounts"]
        assert any(m["name"] == vol["name"] and m["mountPath"] == shm_dir for m in mounts), \
            f"{name} must mount {host} at {shm_dir}: the store hands out paths there"
        assert 10001 in spec["securityContext"]["supplementalGroups"]


def test_monitoring_matches_the_service_and_alerts():
    service = k8s_object("Service", "kvstore")
    monitor = k8s_object("ServiceMonitor", "kvstore")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    rule = k8s_object("PrometheusRule", "kvstore")
    alerts = load_yaml_docs(DEPLOY / "prometheus/alerts.yml")[0]
    assert rule["spec"]["groups"] == alerts["groups"], \
        "k8s/monitoring/prometheusrule.yaml must carry alerts.yml's groups"


def test_grafana_dashboard_uses_the_provisioned_datasource():
    ds = load_yaml_docs(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")[0]
    uid = ds["datasources"][0]["uid"]
    dash = json.loads((DEPLOY / "grafana/kvstore.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    for p in panels:
        assert p["datasource"]["uid"] == uid, p["title"]
        assert p["targets"], p["title"]


def test_compose_mounts_files_that_exist():
    compose = load_yaml_docs(DEPLOY / "compose/compose.yaml")[0]
    stages = {rest.split(" AS ")[-1].strip() for word, rest in dockerfile() if word == "FROM"}
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / "compose" / src).exists(), f"{name}: {src} is missing"
        build = svc.get("build")
        if build:
            assert (DEPLOY / "compose" / build["context"] / build["dockerfile"]).exists()
            assert build["target"] in stages, f"{name}: no stage {build['target']}"


def test_engine_configs_are_valid_connector_configs():
    """The JSON that compose and the engine manifests hand to vLLM and SGLang."""
    compose = load_yaml_docs(DEPLOY / "compose/compose.yaml")[0]
    configs = [compose["services"]["engine"]["command"]]
    configs += [k8s_object("Deployment", n)["spec"]["template"]["spec"]["containers"][0]["args"]
                for n in ("vllm", "sglang")]
    seen = 0
    for args in configs:
        for flag, value in itertools.pairwise(args):
            if flag == "--kv-transfer-config":
                cfg = json.loads(value)
                assert cfg["kv_connector"] == "KVStoreConnector"
                ConnectorConfig.from_mapping(cfg["kv_connector_extra_config"], role=cfg["kv_role"])
                seen += 1
            elif flag == "--hicache-storage-backend-extra-config":
                cfg = json.loads(value)
                assert cfg["class_name"] == "KVStoreHiCacheStorage"
                ours = {k: v for k, v in cfg.items()
                        if k not in ("backend_name", "module_path", "class_name", "interface_v1")}
                ConnectorConfig.from_mapping(ours)
                seen += 1
            else:
                continue
            module = cfg.get("kv_connector_module_path") or cfg["module_path"]
            cls = cfg.get("kv_connector") or cfg["class_name"]
            spec = importlib.util.find_spec(module)
            assert spec and spec.origin, f"no module {module}"
            tree = ast.parse(pathlib.Path(spec.origin).read_text())
            assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}, \
                f"{module} defines no class {cls}"
    assert seen == 3


def test_image_sets_no_kvstore_settings():
    # Environment variables beat the config file, so a KVSTORE_* in the image would
    # silently override the TOML an operator mounts.
    env = " ".join(rest for word, rest in final_stage(dockerfile()) if word == "ENV")
    assert "KVSTORE_" not in env


def test_image_copies_every_package_folder():
    """The build stage copies folders one by one (so a change to tests or docs does not
    rebuild it): a package folder added to setup.py's ROOTS must be copied too."""
    setup = ast.parse((DEPLOY.parent / "setup.py").read_text())
    roots = next(ast.literal_eval(node.value) for node in setup.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ROOTS")
    folders = set(roots.values())
    copied = {rest.split()[0] for word, rest in dockerfile() if word == "COPY"}
    assert folders <= copied, f"deploy/Dockerfile does not copy {sorted(folders - copied)}"
