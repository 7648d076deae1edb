"""Client certificates as identities, against a real kvstore-server with mutual TLS: an
auth file names tenants by their certificate's SHA-256 fingerprint, and a connection
that presents one acts for that tenant without a token, over gRPC and the fast path.

Certificates are made at test time by the openssl command (tests/integration/test_tls.py).
"""

from __future__ import annotations

import hashlib
import signal
import ssl

import grpc
import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError
from kvstore_client.fastpath import FastPath
from kvstore_protocol import fastwire as fw
from kvstore_testing.serverproc import ServerProcess, free_port

from .test_fastpath import (
    LAYOUTS,
    Raw,
    fast_address,
    keys,
    keys_body,
    metric,
    pages,
    wait_for,
)
from .test_tls import EC, openssl, signed

CODE = grpc.StatusCode
TOKEN_B = "tenant-b-token"
LAYOUT = LAYOUTS["odd"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """ca.pem; server.{pem,key}; client certificates a, b and stranger (signed by the
    same CA, named in no auth file)."""
    import shutil
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    folder = tmp_path_factory.mktemp("pki")
    openssl(folder, "req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=kvstore test ca", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    signed(folder, "server", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    for name in ("a", "b", "stranger"):
        signed(folder, name, "clientAuth")
    return folder


def fingerprint(pki, name: str) -> str:
    """As the docs say to get it: `openssl x509 -noout -fingerprint -sha256` (colons)."""
    import subprocess
    out = subprocess.run(["openssl", "x509", "-in", str(pki / f"{name}.pem"), "-noout",
                          "-fingerprint", "-sha256"], check=True, capture_output=True,
                         text=True).stdout
    return out.strip().partition("=")[2]


def write_auth(path, pki, tenants: list[str]) -> None:
    """Tenant a by certificate only; b by certificate and a token; an admin by token."""
    out = ['[admins.ops]\ntoken_sha256 = "' + hashlib.sha256(b"ops").hexdigest() + '"']
    if "a" in tenants:
        out.append(f'[tenants.a]\ncert_sha256 = "{fingerprint(pki, "a")}"')
    if "b" in tenants:
        out.append(f'[tenants.b]\ncert_sha256 = "{fingerprint(pki, "b")}"\n'
                   f'token_sha256 = "{hashlib.sha256(TOKEN_B.encode()).hexdigest()}"')
    path.write_text("\n".join(out) + "\n")


@pytest.fixture
def server(pki, tmp_path):
    from .test_tls import creds
    auth = tmp_path / "auth.toml"
    write_auth(auth, pki, ["a", "b"])
    port = free_port()
    # The health check presents a certificate signed by the CA: client.pem here is a's.
    for ext in ("pem", "key"):
        (pki / f"client.{ext}").write_bytes((pki / f"a.{ext}").read_bytes())
    with ServerProcess(credentials=creds(pki, client_cert=True), tls_cert=pki / "server.pem",
                       tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem",
                       auth_file=auth, metrics_port=port, dram="128MiB") as srv:
        srv.metrics_port = port
        srv.auth_path = auth
        yield srv


def client(pki, srv, name: str, *, token: str | None = None, fast: bool) -> KVStoreClient:
    return KVStoreClient(srv.address, token=token, tls_ca=str(pki / "ca.pem"),
                         tls_cert=str(pki / f"{name}.pem"), tls_key=str(pki / f"{name}.key"),
                         shared_memory=False, data_plane=fast, retries=0)


def tls_context(pki, name: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / f"{name}.pem"), str(pki / f"{name}.key"))
    return ctx


def raw(pki, srv, name: str, token: str = "") -> tuple[Raw, int, bytes]:
    """A fast-path connection over TLS with name's certificate: (it, HELLO's status, body)."""
    conn = Raw(fast_address(srv), hello=False)
    conn.sock = tls_context(pki, name).wrap_socket(conn.sock, server_hostname="127.0.0.1")
    status, body = conn.call(fw.Op.HELLO, token.encode())
    return conn, status, body


def test_a_tenant_by_certificate_sees_only_its_own_layouts(pki, server):
    ks = keys("cert", 5)
    data = pages(5, LAYOUT.page_bytes, seed=5)
    for fast in (False, True):              # gRPC, then the fast path
        with client(pki, server, "a", fast=fast) as a, \
                client(pki, server, "b", fast=fast) as b:
            ns = a.register_layout(LAYOUT)
            a.put(ns, ks, data)
            assert np.array_equal(a.get(ns, ks), data)
            if fast:
                assert not a.fast_path().address.endswith(".sock")
                assert a.fast_path().tenant == "a" and b.fast_path().tenant == "b"
            else:
                assert a.fast_path() is None
            nb = b.register_layout(LAYOUT)
            assert b.lookup(nb, ks) == 0           # the same layout is b's own namespace
            with pytest.raises(KeyError):
                b.get(nb, ks)
            a.delete(ns, ks)
    # b names a's layout id and keys on the fast path (its token agrees with its
    # certificate): the id is b's own layout there, where a's pages are not.
    with client(pki, server, "a", fast=True) as a:
        ns = a.register_layout(LAYOUT)
        a.put(ns, ks, data)
    conn, status, body = raw(pki, server, "b", TOKEN_B)
    assert status == 0 and body == b"b"
    status, body = conn.call(fw.Op.GET, keys_body(ns.layout_id, ks))
    assert status == fw.Status.NOT_FOUND, body
    conn.close()


def test_an_unknown_or_disagreeing_certificate_is_refused_and_counted(pki, server):
    port = server.metrics_port
    with client(pki, server, "stranger", fast=False) as c:
        with pytest.raises(KVStoreError) as info:
            c.register_layout(LAYOUT)
    assert info.value.code == CODE.UNAUTHENTICATED
    assert "not named in the auth file" in info.value.message
    assert metric(port, 'kvstore_rpc_total{code="UNAUTHENTICATED",method="RegisterLayout"}') == 1
    # a's certificate with b's token: two callers at once, refused on both paths.
    with client(pki, server, "a", token=TOKEN_B, fast=False) as c:
        with pytest.raises(KVStoreError, match="the bearer token names tenant 'b'") as info:
            c.register_layout(LAYOUT)
    assert info.value.code == CODE.UNAUTHENTICATED
    for name, token, words in (("stranger", "", b"not named in the auth file"),
                               ("a", TOKEN_B, b"client certificate tenant 'a'")):
        conn, status, body = raw(pki, server, name, token)
        assert status == fw.Status.UNAUTHENTICATED and words in body, body
        assert conn.closed()
        conn.close()
    with pytest.raises(KVStoreError) as info:        # the client says why, not "unreachable"
        FastPath(fast_address(server), tls=tls_context(pki, "stranger")).check()
    assert info.value.code == CODE.UNAUTHENTICATED
    wait_for(lambda: metric(port, 'kvstore_fast_refused_total{reason="unauthenticated"}') == 3,
             "the refused connections to be counted")


def test_a_certificate_removed_on_reload_is_refused_on_open_connections(pki, server):
    with client(pki, server, "a", fast=False) as by_grpc, \
            client(pki, server, "a", fast=True) as by_fast:
        ns = by_grpc.register_layout(LAYOUT)
        ks = keys("revoke", 2)
        by_grpc.put(ns, ks, pages(2, LAYOUT.page_bytes))
        assert by_fast.lookup(ns, ks) == 2             # its connection is open now
        conn, status, _ = raw(pki, server, "a")
        assert status == 0
        write_auth(server.auth_path, pki, ["b"])
        server.send_signal(signal.SIGHUP)
        wait_for(lambda: "auth reloaded" in server.log(), "the reload")
        for c in (by_grpc, by_fast):
            with pytest.raises(KVStoreError, match="not named in the auth file") as info:
                c.lookup(ns, ks)
            assert info.value.code == CODE.UNAUTHENTICATED
        # A refused PUT's pages are read past: the connection stays in step.
        body = keys_body(ns.layout_id, ks[:1])
        conn.send(fw.Op.PUT, body, data_len=LAYOUT.page_bytes)
        conn.sock.sendall(bytes(LAYOUT.page_bytes))
        status, answer, _ = conn.answer()
        assert status == fw.Status.UNAUTHENTICATED, answer
        status, answer = conn.call(fw.Op.EXISTS, body)
        assert status == fw.Status.UNAUTHENTICATED and b"not named" in answer
        conn.close()
    # b, whose entry stayed, still works by certificate alone.
    with client(pki, server, "b", fast=True) as b:
        assert b.lookup(b.register_layout(LAYOUT), ks) == 0
