"""Start-up mistakes, each made on a real kvstore-server process: it must exit non-zero within
5 s with one line that names the setting, print no traceback, and leave no file in its
--shm-dir (a fresh folder in /dev/shm, so free-space checks see tmpfs)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore_testing.serverproc import ServerProcess, free_port

SERVER = [sys.executable, "-m", "kvstore_server.main"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shm_dir():
    path = tempfile.mkdtemp(prefix="kvstore-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_fails(shm_dir: str, *flags: str, setting: str, code: int = 78,
                server: list[str] = SERVER) -> str:
    """Run the server with flags; assert the failure contract; return its output."""
    started = time.monotonic()
    proc = subprocess.run([*server, "--listen", f"127.0.0.1:{free_port()}",
                           "--shm-dir", shm_dir, *flags], capture_output=True, text=True,
                          timeout=30)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    print(f"{' '.join(flags)}: rc {proc.returncode} in {elapsed:.2f}s: {out.strip()}")
    assert proc.returncode == code, out
    # About 1 s alone on the 2-core machine; up to 7.5 s seen while other suites ran
    # beside it. The bound is against waiting or retrying, not a benchmark.
    assert elapsed < 15, f"took {elapsed:.1f}s"
    assert "Traceback" not in out, out
    failures = [line for line in out.splitlines()
                if "ERROR" in line or line.startswith("kvstore-server:")]
    assert len(failures) == 1 and setting in failures[0], out
    assert os.listdir(shm_dir) == [], os.listdir(shm_dir)
    return out


# -- settings that are wrong on their face: refused before anything is touched ------------------
@pytest.mark.parametrize("flags, setting", [
    (["--listen", "127.0.0.1:99999"], "listen"),
    (["--listen", "127.0.0.1:65536"], "listen"),
    (["--listen", "127.0.0.1:0"], "listen"),
    (["--metrics-port", "70000"], "metrics_port"),
    (["--log-level", "bogus"], "log_level"),
    (["--dram", "lots"], "dram"),
])
def test_malformed_setting(shm_dir, flags, setting):
    start_fails(shm_dir, *flags, setting=setting, code=2)


# -- settings this host cannot honour: refused before a port is bound or the pool exists -------
def test_pool_larger_than_memory(shm_dir):
    start_fails(shm_dir, "--dram", "500GiB", setting="dram")


def test_pool_larger_than_memory_in_dev_shm():
    """The issue's case as an operator hits it: /dev/shm itself, 500 GiB."""
    proc = subprocess.Popen([*SERVER, "--listen", f"127.0.0.1:{free_port()}", "--dram",
                             "500GiB"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 78 and "dram: 500.0 GiB" in out and "Traceback" not in out, out
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvstore-{proc.pid}-")]


def test_pool_larger_than_a_small_tmpfs(tmp_path):
    """A 256 MiB tmpfs and a 1 GiB pool: this died of SIGBUS, leaving its file."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        out = start_fails(str(mnt), "--dram", "1GiB", setting="dram")
        assert "256.0 MiB free" in out
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_pool_allocation_that_runs_out_of_space(shm_dir):
    """The space the checks saw can be gone by the time the pool is allocated (another
    process took it). Played with RLIMIT_FSIZE: the checks pass, posix_fallocate fails.
    Before it, the sparse file was created and the pre-fault died of SIGBUS."""
    # The limit is set by the server's own interpreter before it runs, not by a
    # preexec_fn: that runs between fork and exec in this process, which other tests
    # leave with threads (a far-tier client's), where Python says it may deadlock; inside
    # the whole suite it took 52 s.
    limited = [sys.executable, "-c",
               "import resource, runpy, sys; "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 20, resource.RLIM_INFINITY)); "
               "sys.argv[0] = 'kvstore-server'; "
               "runpy.run_module('kvstore_server.main', run_name='__main__')"]
    out = start_fails(shm_dir, "--dram", "64MiB", setting="dram", server=limited)
    assert "cannot allocate" in out


def test_shm_dir_missing(shm_dir):
    start_fails(shm_dir, "--shm-dir", os.path.join(shm_dir, "nope"), setting="shm_dir")


def test_unknown_group(shm_dir):
    start_fails(shm_dir, "--shm-group", "nosuchgroup-kvstore", setting="shm_group")


@pytest.mark.parametrize("missing", ["tls_cert", "tls_key", "tls_client_ca"])
def test_tls_file_missing(shm_dir, tmp_path, missing):
    files = {}
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        files[name] = tmp_path / f"{name}.pem"
        if name != missing:
            files[name].write_text("not checked before the missing one\n")
    out = start_fails(shm_dir, "--tls-cert", str(files["tls_cert"]), "--tls-key",
                      str(files["tls_key"]), "--tls-client-ca", str(files["tls_client_ca"]),
                      setting=missing)
    assert str(files[missing]) in out


def test_auth_file_missing(shm_dir, tmp_path):
    start_fails(shm_dir, "--auth-file", str(tmp_path / "auth.toml"), setting="auth file")


def test_disk_dir_not_a_folder(shm_dir, tmp_path):
    (tmp_path / "file").write_text("")
    start_fails(shm_dir, "--disk", "64MiB", "--disk-dir", str(tmp_path / "file" / "disk"),
                setting="disk_dir")


def test_disk_larger_than_its_file_system(shm_dir, tmp_path):
    start_fails(shm_dir, "--disk", "1000TiB", "--disk-dir", str(tmp_path / "disk"),
                setting="disk")


def test_disk_dir_of_a_running_server(shm_dir, tmp_path):
    """The disk tier's folder lock fails after the ports are bound: the pool is not made."""
    disk = str(tmp_path / "disk")
    with ServerProcess(dram="16MiB", disk="64MiB", disk_dir=disk):
        start_fails(shm_dir, "--dram", "64MiB", "--disk", "64MiB", "--disk-dir", disk,
                    setting="disk_dir")


# -- ports: bound before the pool, so a port in use costs no pre-fault -------------------------
# A port held by another process may be the last server still stopping or another local
# user's: exit 75, which the systemd unit restarts, never 78, which it does not.
PORT_TAKEN = 75


def test_listen_port_in_use(shm_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # 2 GiB would take seconds to pre-fault: the failure must come before it.
        out = start_fails(shm_dir, "--dram", "2GiB", "--listen", f"127.0.0.1:{port}",
                          setting="listen", code=PORT_TAKEN)
    assert "in use" in out and "allocating" not in out


def test_metrics_port_in_use(shm_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = start_fails(shm_dir, "--dram", "2GiB", "--metrics-port", str(port),
                          setting="metrics_port", code=PORT_TAKEN)
    assert str(port) in out and "in use" in out and "allocating" not in out


def test_a_congestion_control_the_kernel_does_not_have(shm_dir):
    """--data-congestion is tried on a socket before the pool exists (preflight.py):
    a name the kernel lacks is one line that names the setting and what the kernel has."""
    out = start_fails(shm_dir, "--dram", "2GiB", "--data-congestion", "nosuch",
                      setting="data_congestion")
    assert "no TCP congestion control 'nosuch'" in out and "reno" in out, out
    assert "allocating" not in out, out


def test_data_port_in_use(shm_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = start_fails(shm_dir, "--data-listen", f"127.0.0.1:{port}",
                          setting="data_listen", code=PORT_TAKEN)
    assert str(port) in out and "in use" in out


def test_unit_restarts_after_a_taken_port():
    unit = (ROOT / "deploy" / "kvstore-server.service").read_text()
    prevent = next(line for line in unit.splitlines()
                   if line.startswith("RestartPreventExitStatus="))
    assert str(PORT_TAKEN) not in prevent.split("=", 1)[1].split()


# -- signals while the pool is being made ---------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_pool_preparation(shm_dir, sig):
    proc = subprocess.Popen([*SERVER, "--listen", f"127.0.0.1:{free_port()}", "--shm-dir",
                             shm_dir, "--dram", "2GiB"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "allocating" in line:
            break
    proc.send_signal(sig)
    sent = time.monotonic()
    out = "".join(lines) + proc.stdout.read()
    proc.wait(10)
    print(f"{sig.name}: rc {proc.returncode} {time.monotonic() - sent:.2f}s after: {out}")
    assert proc.returncode == 128 + sig, out
    assert f"stopped by {sig.name} during start-up" in out and "Traceback" not in out, out
    assert os.listdir(shm_dir) == []


def test_start_up_undo_removes_this_process_files_only(tmp_path):
    """The sweep start-up registers before making the pool: a signal that lands between the
    file's creation and its close being registered (the race above) still leaves nothing."""
    from kvstore_server.region import remove_own
    mine = [f"kvstore-{os.getpid()}-0123abcd", f"kvstore-{os.getpid()}-0123abcd.sock"]
    others = [f"kvstore-{os.getpid() + 1}-0123abcd", "kvstore-notes.txt"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"x")
    remove_own(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(others)


# -- what a good start-up says ---------------------------------------------------------------------
def test_check_config(shm_dir):
    ok = subprocess.run([*SERVER, "--check-config", "--shm-dir", shm_dir, "--dram", "64MiB"],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "config OK" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([*SERVER, "--check-config", "--shm-dir", shm_dir, "--dram", "500GiB"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 78 and bad.stderr.startswith("kvstore-server: dram:"), bad.stderr
    assert os.listdir(shm_dir) == []


def test_version():
    from kvstore_server import __version__
    out = subprocess.run([*SERVER, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == f"kvstore-server {__version__}"


def test_systemd_readiness_comes_when_serving(shm_dir, tmp_path):
    """Type=notify: READY=1 only once the port answers SERVING, after the pool's progress."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(30)
        srv = ServerProcess(dram="256MiB", shm_dir=shm_dir, env={"NOTIFY_SOCKET": path})
        srv.proc = subprocess.Popen([*SERVER, "--listen", srv.address, *srv.args],
                                    env=srv.env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        try:
            messages = []
            while not any("READY=1" in m for m in messages):
                messages.append(sock.recv(4096).decode())
            with grpc.insecure_channel(srv.address) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert any("preparing the pool" in m for m in messages[:-1]), messages
            assert f"MAINPID={srv.proc.pid}" in messages[-1]
            srv.proc.send_signal(signal.SIGTERM)
            assert "STOPPING=1" in sock.recv(4096).decode()
            assert srv.proc.wait(15) == 0
        finally:
            if srv.proc.poll() is None:
                srv.proc.kill()
    assert os.listdir(shm_dir) == []
