"""Build the server image from deploy/Dockerfile, start it and ask it for health.

Off by default: it needs the Debian archive and PyPI, buildah and debootstrap, and takes
minutes (on the 2-core dev VM: base by debootstrap ~2 min, once; image build ~1 min).
Run it with KVSTORE_IMAGE_TEST=1 (apt-get install buildah debootstrap). With no Docker
engine to lean on, it builds a Debian base with debootstrap, builds with buildah in chroot
isolation (no daemon, no user namespaces needed), and runs the image's own ENTRYPOINT and
HEALTHCHECK, read from the built image, inside a container of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from kvstore_testing.serverproc import free_port

from .deployfiles import ROOT, dockerfile, exec_form, final_stage, healthcheck_command

pytestmark = pytest.mark.slow

BASE = os.environ.get("KVSTORE_IMAGE_BASE", "localhost/kvstore-test-base:bookworm")
IMAGE = "localhost/kvstore:test"
MIRROR = os.environ.get("KVSTORE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# vfs: works wherever root can write files (no overlay mounts inside a container).
BUILDAH = ["buildah", "--storage-driver", "vfs"]


def _sh(argv, timeout=600, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{argv}: {out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _ensure_base(tmp_path) -> None:
    """A Debian bookworm image with python3 and its venv module, made once by debootstrap."""
    if subprocess.run(BUILDAH + ["inspect", "--type", "image", BASE],
                      capture_output=True).returncode == 0:
        return
    rootfs = tmp_path / "rootfs"
    _sh(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
         "bookworm", str(rootfs), MIRROR], timeout=900)
    _sh(["tar", "-C", str(rootfs), "-cf", str(tmp_path / "rootfs.tar"), "."])
    ctr = _sh(BUILDAH + ["from", "scratch"]).stdout.strip()
    try:
        _sh(BUILDAH + ["add", ctr, str(tmp_path / "rootfs.tar"), "/"])
        _sh(BUILDAH + ["commit", ctr, BASE])
    finally:
        subprocess.run(BUILDAH + ["rm", ctr], capture_output=True)


def _build(tmp_path) -> dict:
    # Where PyPI sits behind a TLS proxy, the host's CA bundle is what pip must trust.
    pip_conf = tmp_path / "pip.conf"
    pip_conf.write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    volumes = ["-v", f"{pip_conf}:/etc/pip.conf:ro"]
    if os.path.exists("/etc/ssl/certs/ca-certificates.crt"):
        volumes += ["-v", "/etc/ssl/certs/ca-certificates.crt:"
                          "/etc/ssl/certs/ca-certificates.crt:ro"]
    _sh(BUILDAH + ["bud", "--format", "docker", "--isolation", "chroot", "--network", "host",
                   *volumes, "--build-arg", f"BASE={BASE}", "-f", "deploy/Dockerfile",
                   "-t", IMAGE, "."], cwd=ROOT, timeout=900)
    info = json.loads(_sh(BUILDAH + ["inspect", "--type", "image", IMAGE]).stdout)
    return info["Docker"]["config"]


def test_image_builds_starts_and_answers_health(tmp_path):
    if os.environ.get("KVSTORE_IMAGE_TEST") != "1":
        pytest.skip("image build off: set KVSTORE_IMAGE_TEST=1 (needs buildah, debootstrap, "
                    "the Debian archive and PyPI; takes minutes)")
    for tool in ("buildah", "debootstrap"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed (apt-get install buildah debootstrap)")
    _ensure_base(tmp_path)
    config = _build(tmp_path)
    stage = final_stage(dockerfile())
    entrypoint = exec_form(next(rest for word, rest in stage if word == "ENTRYPOINT"))
    assert config["Entrypoint"] == entrypoint
    assert config["Healthcheck"]["Test"] == ["CMD", *healthcheck_command(stage)]
    assert config["User"] == "10001:10001"

    ctr = _sh(BUILDAH + ["from", IMAGE]).stdout.strip()
    run = BUILDAH + ["run", "--isolation", "chroot", "--network", "host",
                     "--user", config["User"], ctr, "--"]
    port = free_port()
    server = subprocess.Popen(run + config["Entrypoint"] + [
        "--listen", f"127.0.0.1:{port}", "--dram", "64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # No torch in the server image; socat (the metrics forwarder) is there.
        _sh(run + ["python3", "-c", "import importlib.util, sys; "
                   "sys.exit(importlib.util.find_spec('torch') is not None)"])
        _sh(run + ["socat", "-V"])
        health = [a.replace("127.0.0.1:50051", f"127.0.0.1:{port}")
                  for a in config["Healthcheck"]["Test"][1:]]
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(run + health, capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                assert out.stdout.strip() == "SERVING"
                break
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, out.stdout + out.stderr
            time.sleep(1)
        # The pool file belongs to the image's user, not root.
        owned = _sh(run + ["find", "/dev/shm", "-maxdepth", "1", "-name", "kvstore-*",
                           "-uid", "10001"]).stdout
        assert owned.strip(), "no pool file of uid 10001 in /dev/shm"
        # A graceful stop, as `docker stop` sends it (STOPSIGNAL SIGTERM). buildah run
        # kills its child on SIGTERM, so the signal goes to the server itself: chroot
        # isolation has no PID namespace, and the pool file is named after the pid.
        pid = int(re.search(r"kvstore-(\d+)-", owned).group(1))
        os.kill(pid, signal.SIGTERM)
        log, _ = server.communicate(timeout=30)
        assert server.returncode == 0 and "stopped" in log, log
    finally:
        server.terminate()
        server.wait(timeout=30)
        subprocess.run(BUILDAH + ["rm", ctr], capture_output=True)
        # vfs keeps a full copy per image (~0.5 GB): keep the base, drop the build.
        subprocess.run(BUILDAH + ["rmi", IMAGE], capture_output=True)
    assert f"listening on 127.0.0.1:{port}" in log, log
