"""The far tier over TLS (rediss://) with an ACL user, on a real 3-master redis-server
cluster whose client ports, cluster bus and slot map are TLS: credentials from the URL
and from a file, the cluster's certificate checked against --far-ca-file, two servers
sharing pages through it; a wrong password, an unknown CA or a namespace outside the
user's key pattern are misses, never errors."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from kvstore_client import KVStoreClient, PageLayout
from kvstore_server.far.client import FarClient
from kvstore_server.far.settings import parse_far
from kvstore_testing.clusterproc import ClusterProcess, TlsFiles
from kvstore_testing.serverproc import ServerProcess
from tests.waiting import wait_for

from .test_tls import EC, openssl, signed

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="needs the openssl command to make certificates")

USER, PASSWORD, FLEET = "kv", "s3cret-pw", "fleet"
LAYOUT = PageLayout(model="far-tls", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    from ..conftest import _cluster_binaries

    binaries = _cluster_binaries()
    folder = tmp_path_factory.mktemp("far-pki")
    for ca in ("ca", "other-ca"):
        openssl(folder, "req", "-x509", *EC, "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "1", "-subj", f"/CN=kvstore far test {ca}",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    signed(folder, "server", "serverAuth,clientAuth", "IP:127.0.0.1,DNS:localhost")
    (folder / "password").write_text(PASSWORD + "\n")
    files = TlsFiles(str(folder / "server.pem"), str(folder / "server.key"),
                     str(folder / "ca.pem"))
    cluster = ClusterProcess(masters=3, binaries=binaries, tls=files,
                             users=(f"{USER} on >{PASSWORD} ~{FLEET}:* +@all",))
    try:
        cluster.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower() and not os.environ.get("CI"):
            pytest.skip(f"{binaries[0]} is built without TLS: {exc}")
        raise
    try:
        yield cluster, folder
    finally:
        cluster.stop()


def _urls(cluster, credentials: str) -> str:
    return ",".join(u.replace("rediss://", f"rediss://{credentials}@") for u in cluster.urls)


def _client(urls: str, folder, ca: str = "ca.pem", **kw) -> FarClient:
    return FarClient(parse_far(urls, timeout=2.0, namespace=kw.pop("namespace", FLEET),
                               ca_file=str(folder / ca), **kw))


def test_credentials_from_the_url_over_tls(tls_cluster):
    cluster, folder = tls_cluster
    client = _client(_urls(cluster, f"{USER}:{PASSWORD}"), folder)
    try:
        layout = os.urandom(16)
        pages = {os.urandom(16): os.urandom(64 << 10) for _ in range(40)}
        assert client.put(layout, list(pages.items())) == 40
        assert all(client.exists(layout, list(pages)))
        got = client.get(layout, list(pages))
        assert [bytes(p) for p in got] == list(pages.values())
        assert client.counters.errors == 0
    finally:
        client.close()


def test_the_password_from_a_file_and_the_user_from_the_url(tls_cluster):
    cluster, folder = tls_cluster
    client = _client(_urls(cluster, USER), folder, password_file=str(folder / "password"))
    try:
        layout, key = os.urandom(16), os.urandom(16)
        assert client.put(layout, [(key, b"page")]) == 1
        assert bytes(client.get(layout, [key])[0]) == b"page"
    finally:
        client.close()


@pytest.mark.parametrize("case", ["wrong password", "unknown CA", "outside the ACL"])
def test_what_the_cluster_refuses_is_misses_never_errors(tls_cluster, case):
    cluster, folder = tls_cluster
    good = _client(_urls(cluster, f"{USER}:{PASSWORD}"), folder)
    creds, ca, namespace = f"{USER}:{PASSWORD}", "ca.pem", FLEET
    if case == "wrong password":
        creds = f"{USER}:nope"
    elif case == "unknown CA":
        ca = "other-ca.pem"            # the cluster's certificate does not verify
    else:
        namespace = "elsewhere"        # the ACL user may touch fleet:* keys only
    bad = _client(_urls(cluster, creds), folder, ca=ca, namespace=namespace)
    try:
        layout, key = os.urandom(16), os.urandom(16)
        assert good.put(layout, [(key, b"page")]) == 1
        if case != "outside the ACL":  # the same key: only the credentials differ
            assert bad.exists(layout, [key]) == [False]
            assert bad.get(layout, [key]) == [None]
        assert bad.put(layout, [(os.urandom(16), b"x")]) == 0
        assert bad.counters.errors > 0 and bad.counters.pages_written == 0
    finally:
        good.close()
        bad.close()


def test_two_servers_share_pages_over_tls(tls_cluster):
    cluster, folder = tls_cluster
    flags = dict(far=_urls(cluster, USER), far_password_file=str(folder / "password"),
                 far_ca_file=str(folder / "ca.pem"), far_namespace=FLEET,
                 far_timeout="2s")
    keys = [os.urandom(16) for _ in range(16)]
    data = np.frombuffer(os.urandom(16 * LAYOUT.page_bytes), np.uint8).reshape(16, -1)
    with ServerProcess(far_write="through", **flags) as a, \
            ServerProcess(far_write="off", **flags) as b, \
            KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb:
        ca.put(ca.register_layout(LAYOUT), keys, data)
        nb = cb.register_layout(LAYOUT)
        wait_for(lambda: cb.lookup(nb, keys) == len(keys), "the pages in the far tier",
                 timeout=10, interval=0.1)
        assert np.array_equal(cb.get(nb, keys), data)
        far = next(t for t in cb.stats().tiers if t.name == "far")
        assert far.state == "reachable" and far.reads == len(keys)
