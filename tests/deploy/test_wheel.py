"""The wheel, as `pip install .` and the container image install it: every package is in
it, and the server it installs starts and answers, outside this checkout.

Our other tests import from an editable install, which maps whole folders and so cannot
notice a package the distribution leaves out: a hand-written package list once missed
kvstore_server.far, kvstore_server.fastpath and kvstore_connector.transfer, and the
installed kvstore-server died at import. Here the wheel is built from exactly the files
deploy/Dockerfile copies into its build stage, installed with --no-deps into a fresh venv
in a temporary folder (the dependencies it needs come from this test's own environment,
so nothing is downloaded), and run from there.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore_testing.serverproc import free_port_pair

from .deployfiles import ROOT, dockerfile

pytestmark = pytest.mark.slow

SRC = "/src"


def _build_stage_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY into /src in the Dockerfile's build stage."""
    copies, stage = [], None
    for word, rest in dockerfile():
        if word == "FROM":
            stage = rest.split()[-1]
        elif word == "COPY" and stage == "build" and not rest.startswith("--"):
            *sources, dest = rest.split()
            if dest.startswith(SRC):
                copies.append((sources, dest))
    assert copies, "deploy/Dockerfile's build stage copies nothing into /src"
    return copies


def _image_source(into: Path) -> Path:
    """The files the image builds its wheel from, laid out as in its /src."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for sources, dest in _build_stage_copies():
        target = into / dest[len(SRC):].strip("/")
        for name in sources:
            path = ROOT / name
            if path.is_dir():
                shutil.copytree(path, target, ignore=ignore)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / path.name)
    return into


def _sh(argv: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    assert out.returncode == 0, f"{argv}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _package_folders(src: Path) -> set[str]:
    """Every folder of the source that holds Python modules, as the wheel should name it."""
    # the import name of each folder: setup.py's ROOTS, read without running setup()
    setup = ast.parse((src / "setup.py").read_text())
    roots: dict[str, str] = next(
        ast.literal_eval(node.value) for node in setup.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ROOTS")
    names = set()
    for name, folder in roots.items():
        for module in (src / folder).rglob("*.py"):
            rel = module.parent.relative_to(src / folder)
            names.add("/".join([name, *rel.parts]))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the source it was built from)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _image_source(tmp / "src")
    # --no-build-isolation: setuptools from this environment, not a download.
    _sh([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(tmp / "dist"), str(src)])
    (whl,) = (tmp / "dist").glob("kvstore-*.whl")
    return whl, src


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv, outside the checkout, with the wheel installed (not editable)."""
    whl, _ = wheel
    venv = tmp_path_factory.mktemp("venv")
    _sh([sys.executable, "-m", "venv", str(venv)])
    _sh([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-index", "--disable-pip-version-check", str(whl)])
    # The dependencies (grpcio, numpy, torch, ...) from this environment's site-packages,
    # appended after the venv's own: a plain path, so this environment's editable install
    # of the checkout (a .pth hook there) is not loaded.
    purelib = Path(_sh([str(venv / "bin/python"), "-c",
                        "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (purelib / "kvstore-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def test_the_wheel_holds_every_package_folder(wheel):
    whl, src = wheel
    with zipfile.ZipFile(whl) as z:
        folders = {name.rpartition("/")[0] for name in z.namelist() if name.endswith(".py")}
    missing = _package_folders(src) - folders
    assert not missing, f"the wheel lacks {sorted(missing)} (setup.py finds packages by " \
                        "their __init__.py: does the folder have one?)"


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    return env


def test_the_installed_packages_import_from_the_venv(installed, tmp_path):
    # Every package, each from the venv and not from the checkout (cwd is elsewhere too).
    probe = """
import importlib, sys
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    assert module.__file__.startswith(sys.prefix), (name, module.__file__)
    print(name, module.__file__)
"""
    names = ["kvstore_server.main", "kvstore_server.far", "kvstore_server.fastpath",
             "kvstore_server.store", "kvstore_server.disk", "kvstore_server.rpc",
             "kvstore_client", "kvstore_connector.transfer", "kvstore_connector.worker",
             "kvstore_connector.scheduler", "kvstore_bench.cli", "kvstore_testing.serverproc"]
    out = _sh([str(installed / "bin/python"), "-c", probe, *names], cwd=tmp_path,
              env=_env(installed))
    assert len(out.stdout.splitlines()) == len(names), out.stdout


def test_the_installed_server_starts_and_answers_health(installed, tmp_path):
    port = free_port_pair()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - the server's, closed after it
    proc = subprocess.Popen([str(installed / "bin/kvstore-server"), "--listen",
                             f"127.0.0.1:{port}", "--dram", "32MiB"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            env=_env(installed))
    try:
        deadline = time.monotonic() + 30
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                assert proc.poll() is None, \
                    f"kvstore-server exited with {proc.returncode}:\n" \
                    + (tmp_path / "server.log").read_text(errors="replace")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if status.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "kvstore-server did not become healthy"
                time.sleep(0.1)
        # and the admin CLI of the same install reads its stats
        out = _sh([str(installed / "bin/kvstore-admin"), "--server", f"127.0.0.1:{port}",
                   "stats"], cwd=tmp_path, env=_env(installed))
        assert out.stdout.strip(), out
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()
