"""TLS and mutual TLS against a real kvstore-server, with a throwaway CA made at test time
by the openssl command (the `cryptography` package is not a dependency)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_testing.serverproc import ServerProcess, free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="needs the openssl command to make certificates")

LAYOUT = PageLayout(model="tls-test", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64)
TOKEN = "tls-tenant-token"
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl(folder, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True,
                   timeout=60)


def signed(folder, name: str, usage: str, san: str = "") -> None:
    """name.key and name.pem, signed by ca.key."""
    openssl(folder, "req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
    ext = folder / f"{name}.ext"
    ext.write_text(f"basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
                   f"extendedKeyUsage={usage}\n" + (f"subjectAltName={san}\n" if san else ""))
    openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", "-extfile", ext.name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """ca.pem, server.{pem,key} (SAN 127.0.0.1 and localhost), client.{pem,key}, and
    other-ca.pem, a CA that signed nothing here."""
    folder = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        openssl(folder, "req", "-x509", *EC, "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "1", "-subj", f"/CN=kvstore test {ca}",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    signed(folder, "server", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    signed(folder, "client", "clientAuth")
    return folder


def creds(pki, client_cert: bool = False) -> grpc.ChannelCredentials:
    """What the health check of ServerProcess needs to reach the server."""
    def read(name: str) -> bytes | None:
        return (pki / name).read_bytes() if client_cert or name == "ca.pem" else None
    return grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))


def roundtrip(client: KVStoreClient) -> None:
    handle = client.register_layout(LAYOUT)
    keys = [bytes([i]) * 16 for i in range(3)]
    pages = np.random.default_rng(0).integers(0, 256, (3, LAYOUT.page_bytes), dtype=np.uint8)
    client.put(handle, keys, pages)
    np.testing.assert_array_equal(client.get(handle, keys), pages)
    assert client.lookup(handle, keys) == 3


def test_tls_round_trip_with_a_token(pki, tmp_path):
    auth = tmp_path / "auth.toml"
    auth.write_text(f'[tenants.t]\ntoken_sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"'
                    "\n")
    with ServerProcess(credentials=creds(pki), tls_cert=pki / "server.pem",
                       tls_key=pki / "server.key", auth_file=auth) as srv:
        assert "auth: 1 tenants, 0 admins" in srv.log() and "; TLS" in srv.log()
        with KVStoreClient(srv.address, token=TOKEN, tls_ca=str(pki / "ca.pem")) as c:
            roundtrip(c)
        # PEM bytes work as well as paths
        with KVStoreClient(srv.address, token=TOKEN, tls_ca=(pki / "ca.pem").read_bytes(),
                           shared_memory=False) as c:
            assert c.lookup(c.register_layout(LAYOUT), [bytes([0]) * 16]) == 1
        # A client that does not trust the server's CA, or speaks plain text, gets nowhere.
        for kw in ({"tls_ca": str(pki / "other-ca.pem")}, {}):
            with KVStoreClient(srv.address, token=TOKEN, retries=0, timeout=3, **kw) as c:
                with pytest.raises(KVStoreError) as info:
                    c.register_layout(LAYOUT)
                assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate(pki):
    with ServerProcess(credentials=creds(pki, client_cert=True), tls_cert=pki / "server.pem",
                       tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem") as srv:
        assert "mutual TLS" in srv.log()
        with KVStoreClient(srv.address, tls_ca=str(pki / "ca.pem"),
                           tls_cert=str(pki / "client.pem"),
                           tls_key=str(pki / "client.key")) as c:
            roundtrip(c)
        with KVStoreClient(srv.address, tls_ca=str(pki / "ca.pem"), retries=0,
                           timeout=3) as c:
            with pytest.raises(KVStoreError) as info:
                c.register_layout(LAYOUT)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE

        # The admin CLI speaks TLS too, health check included.
        base = [sys.executable, "-m", "kvstore_client.admin_cli", "--server", srv.address,
                "--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"),
                "--tls-key", str(pki / "client.key")]
        for command in (["health"], ["layouts"]):
            proc = subprocess.run([*base, *command], capture_output=True, text=True,
                                  timeout=60, check=False, env=dict(os.environ))
            assert proc.returncode == 0, proc.stderr
        proc = subprocess.run([*base[:5], "health"], capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr


def test_unreadable_certificate_stops_the_start(pki, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore_server.main", "--listen", f"127.0.0.1:{free_port()}",
         "--dram", "64MiB", "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key",
         str(pki / "server.key")], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "missing.pem" in proc.stderr


def test_connector_settings_reach_a_tls_server_with_mutual_tls(pki):
    """The connector's tls_* settings (vLLM's kv_connector_extra_config, SGLang's
    extra_config) make every client it opens speak (mutual) TLS."""
    from kvstore_connector.config import ConnectorConfig, open_client
    with ServerProcess(credentials=creds(pki, client_cert=True), tls_cert=pki / "server.pem",
                       tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem") as srv:
        config = ConnectorConfig.from_mapping({
            "server": srv.address, "tls_ca": str(pki / "ca.pem"),
            "tls_cert": str(pki / "client.pem"), "tls_key": str(pki / "client.key")})
        with open_client(config, 10.0) as c:
            roundtrip(c)
        plain = ConnectorConfig.from_mapping({"server": srv.address})
        with open_client(plain, 3.0, retries=0) as c:
            with pytest.raises(KVStoreError) as info:
                c.register_layout(LAYOUT)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError, match="needs both tls_cert and tls_key"):
        ConnectorConfig.from_mapping({"tls_cert": str(pki / "client.pem")})
