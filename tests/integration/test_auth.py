"""Bearer tokens, tenant isolation, quotas, SIGHUP reload and the listen-address guard,
against a real kvstore-server process started with --auth-file."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore_client import KVStoreClient, KVStoreError, LayoutHandle, PageLayout
from kvstore_client.channel import open_channel
from kvstore_connector.config import ConnectorConfig, LookupMode
from kvstore_connector.scheduler import SchedulerHalf
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore_server.tenants import scoped_layout_id
from kvstore_testing.serverproc import ServerProcess, free_port
from tests.waiting import wait_for

# 256 KiB pages: four of them fill the 1 MiB quota of tenant "small".
LAYOUT = PageLayout(model="auth-test", num_layers=4, page_tokens=16, num_kv_heads=8,
                    head_size=128)
OTHER = PageLayout(model="auth-other", num_layers=2, page_tokens=16, num_kv_heads=2,
                   head_size=64)
TOKENS = {"a": "tok-a-0123", "b": "tok-b-4567", "small": "tok-small-89", "engine": "tok-eng",
          "ops": "tok-ops-admin", "default": "tok-default-0"}
CODE = grpc.StatusCode


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def auth_toml(**entries: str) -> str:
    """[tenants.NAME] for every name but "ops", which is [admins.ops]; extra keys as given."""
    out = []
    for name, extra in entries.items():
        table = "admins" if name == "ops" else "tenants"
        out.append(f'[{table}.{name}]\ntoken_sha256 = "{sha(TOKENS[name])}"\n{extra}\n')
    return "\n".join(out)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "auth.toml"
    path.write_text(auth_toml(a="", b="", small='quota = "1MiB"', engine="shared_memory = true",
                              ops=""))
    with ServerProcess(dram="64MiB", auth_file=str(path)) as server:
        yield server


def client(srv, name: str | None, **kw) -> KVStoreClient:
    return KVStoreClient(srv.address, token=TOKENS.get(name, name), retries=0, **kw)


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def pages(n: int, page_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def raw(srv, name: str, method: str, request, response_type):
    """One KVStore call as `name`, with no client logic (no re-registration, no retry)."""
    with open_channel(srv.address, token=TOKENS[name]) as channel:
        call = channel.unary_unary(f"/kvstore.v1.KVStore/{method}",
                                   request_serializer=type(request).SerializeToString,
                                   response_deserializer=response_type.FromString)
        return call(request, timeout=10)


def code_of(excinfo) -> grpc.StatusCode:
    return excinfo.value.code()


# -- who may call ----------------------------------------------------------------------
def test_no_token_or_a_bad_one_is_unauthenticated(srv):
    handle = LayoutHandle(LAYOUT, LAYOUT.layout_id, LAYOUT.page_bytes, LAYOUT.layer_bytes)
    for name, words in ((None, "missing bearer token"), ("not-a-token", "invalid token")):
        with client(srv, name) as c:
            with pytest.raises(KVStoreError) as info:
                c.register_layout(LAYOUT)
            assert info.value.code == CODE.UNAUTHENTICATED and words in info.value.message
            with pytest.raises(KVStoreError) as info:
                c.stats()
            assert info.value.code == CODE.UNAUTHENTICATED
            with pytest.raises(KVStoreError) as info:          # streaming calls too
                c.put(handle, keys("x", 1), pages(1, LAYOUT.page_bytes))
            assert info.value.code == CODE.UNAUTHENTICATED
            with pytest.raises(KVStoreError) as info:
                c.get(handle, keys("x", 1))
            assert info.value.code == CODE.UNAUTHENTICATED


def test_refused_calls_are_counted_in_the_metrics(fresh_server, tmp_path):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    path = tmp_path / "auth.toml"
    path.write_text(auth_toml(a="", ops=""))
    port = free_port()
    srv = fresh_server(auth_file=str(path), metrics_port=port)
    with client(srv, None) as c, client(srv, "a") as tenant:
        for _ in range(2):
            with pytest.raises(KVStoreError):
                c.register_layout(LAYOUT)
        with pytest.raises(KVStoreError):
            tenant.stats()                                  # an Admin call by a tenant
        tenant.register_layout(LAYOUT)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    calls = {(s.labels["method"], s.labels["code"]): s.value
             for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "kvstore_rpc_total"}
    assert calls[("RegisterLayout", "UNAUTHENTICATED")] == 2
    assert calls[("Stats", "PERMISSION_DENIED")] == 1
    assert calls[("RegisterLayout", "OK")] == 1


def test_roles_are_kept_apart(srv):
    with client(srv, "a") as c:
        with pytest.raises(KVStoreError) as info:
            c.stats()
        assert info.value.code == CODE.PERMISSION_DENIED
        assert "tenant 'a'" in info.value.message and "admin token" in info.value.message
        for call in (c.clear, c.list_layouts):
            with pytest.raises(KVStoreError) as info:
                call()
            assert info.value.code == CODE.PERMISSION_DENIED
    with client(srv, "ops") as c:
        with pytest.raises(KVStoreError) as info:
            c.register_layout(LAYOUT)
        assert info.value.code == CODE.PERMISSION_DENIED
        assert c.stats().version


def test_health_and_reflection_need_no_token(srv):
    with grpc.insecure_channel(srv.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in answer.list_services_response.service}
        assert {"kvstore.v1.KVStore", "kvstore.v1.Admin"} <= names


# -- isolation -------------------------------------------------------------------------
def test_a_tenant_sees_nothing_of_another(srv):
    ks = keys("iso", 6)
    data = pages(6, LAYOUT.page_bytes, seed=1)
    with client(srv, "a") as a, client(srv, "b") as b, client(srv, "ops") as ops:
        ha, hb = a.register_layout(LAYOUT), b.register_layout(LAYOUT)
        assert ha.layout_id == hb.layout_id == LAYOUT.layout_id   # clients see their own id
        assert a.put(ha, ks, data).stored == 6
        assert b.lookup(hb, ks) == 0
        assert b.exists(hb, ks) == [False] * 6
        with pytest.raises(KeyError):
            b.get(hb, ks[:1])
        assert b.lookup_lease(hb, ks, lease_ms=5000).lease_id == 0
        assert b.delete(hb, ks) == 0
        # b stores the same keys in the same layout: its own pages, a's stay as they were
        b.put(hb, ks[:2], pages(2, LAYOUT.page_bytes, seed=2))
        np.testing.assert_array_equal(a.get(ha, ks), data)
        assert a.lookup(ha, ks) == 6

        # A lease id is a small integer; b cannot end a's.
        lease = a.lookup_lease(ha, ks, lease_ms=60_000)
        assert lease.count == 6 and not b.release_lease(lease.lease_id)
        assert ops.stats().leased_pages == 6
        assert a.release_lease(lease)

        # A layout b never registered is unknown to b, whoever else has it.
        ho = a.register_layout(OTHER)
        for method, request, response in (
                ("Exists", pb.ExistsRequest, pb.ExistsResponse),
                ("Lookup", None, pb.LookupResponse),
                ("Delete", pb.DeleteRequest, pb.DeleteResponse)):
            packed = pb.PackedKeys(data=b"".join(ks), key_size=16)
            req = (pb.LookupRequest(layout_ids=[ho.layout_id], keys=packed) if request is None
                   else request(layout_id=ho.layout_id, keys=packed))
            with pytest.raises(grpc.RpcError) as info:
                raw(srv, "b", method, req, response)
            assert code_of(info) == CODE.INVALID_ARGUMENT
            assert info.value.details().startswith(f"unknown layout {ho.layout_id.hex()}")
        with open_channel(srv.address, token=TOKENS["b"]) as channel, \
                pytest.raises(grpc.RpcError) as info:
            get = channel.unary_stream("/kvstore.v1.KVStore/Get",
                                       request_serializer=pb.GetRequest.SerializeToString)
            list(get(pb.GetRequest(layout_id=ho.layout_id, keys=packed), timeout=10))
        assert code_of(info) == CODE.INVALID_ARGUMENT

        # Admins see every tenant's layouts, each under its store id.
        mine = [s for s in ops.list_layouts() if s.layout.model == "auth-test"]
        assert {s.tenant for s in mine} >= {"a", "b"}
        assert len({s.layout_id for s in mine}) == len(mine)
        a.delete(ha, ks)
        b.delete(hb, ks)


def test_a_tenant_named_default_cannot_reach_others_by_their_store_ids(tmp_path):
    # The built-in tenant's store ids are the clients' own; another tenant's store id is
    # a hash of its name and layout, both guessable. Layouts are checked by owner.
    path = tmp_path / "auth.toml"
    path.write_text(auth_toml(a="", default=""))
    ks = keys("backdoor", 2)
    with ServerProcess(dram="64MiB", auth_file=str(path)) as server:
        with client(server, "a") as a:
            a.put(a.register_layout(LAYOUT), ks, pages(2, LAYOUT.page_bytes))
        packed = pb.PackedKeys(data=b"".join(ks), key_size=16)
        with pytest.raises(grpc.RpcError) as info:
            raw(server, "default", "Lookup", pb.LookupRequest(
                layout_ids=[scoped_layout_id("a", LAYOUT.layout_id)], keys=packed),
                pb.LookupResponse)
        assert code_of(info) == CODE.INVALID_ARGUMENT
        with client(server, "default") as d:       # its own layouts work as usual
            hd = d.register_layout(LAYOUT)
            assert d.lookup(hd, ks) == 0 and d.put(hd, ks, pages(2, LAYOUT.page_bytes)).stored == 2


def test_shared_memory_only_for_trusted_tenants(srv):
    ks = keys("shm", 2)
    with client(srv, "a") as a:                      # shared_memory=None: falls back
        h = a.register_layout(LAYOUT)
        assert a.region() is None
        a.put(h, ks, pages(2, LAYOUT.page_bytes))
        assert a.get(h, ks).shape == (2, LAYOUT.page_bytes)
        a.delete(h, ks)
    with client(srv, "a", shared_memory=True) as a:  # required: a clear error
        h = a.register_layout(LAYOUT)
        with pytest.raises(KVStoreError, match="may not use the shared-memory pool"):
            a.put(h, ks, pages(2, LAYOUT.page_bytes))
    with pytest.raises(grpc.RpcError) as info:       # nor its calls, token or not
        raw(srv, "a", "Reserve", pb.ReserveRequest(
            layout_id=LAYOUT.layout_id, keys=pb.PackedKeys(data=b"".join(ks), key_size=16)),
            pb.ReserveResponse)
    assert code_of(info) == CODE.PERMISSION_DENIED

    with client(srv, "engine", shared_memory=True) as e:
        h = e.register_layout(LAYOUT)
        data = pages(2, LAYOUT.page_bytes, seed=3)
        e.put(h, ks, data)
        np.testing.assert_array_equal(e.get(h, ks), data)
        # Another tenant cannot commit, abort or release the engine's leases.
        res = e.reserve(h, keys("shm2", 1))
        with pytest.raises(grpc.RpcError) as info:
            raw(srv, "a", "Commit", pb.CommitRequest(lease_id=res.lease_id), pb.CommitResponse)
        assert code_of(info) == CODE.FAILED_PRECONDITION
        assert "unknown or has expired" in info.value.details()
        assert not raw(srv, "a", "Abort", pb.AbortRequest(lease_id=res.lease_id),
                       pb.AbortResponse).aborted
        res.abort()
        acq = e.acquire(h, ks)
        assert not raw(srv, "a", "ReleaseLease", pb.ReleaseLeaseRequest(lease_id=acq.lease_id),
                       pb.ReleaseLeaseResponse).released
        acq.release()
        e.delete(h, ks)


# -- quotas ----------------------------------------------------------------------------
def test_quota(srv):
    ks = keys("q", 8)
    with client(srv, "small") as s, client(srv, "b") as b, client(srv, "ops") as ops:
        hs, hb = s.register_layout(LAYOUT), b.register_layout(LAYOUT)
        b.put(hb, keys("bq", 4), pages(4, LAYOUT.page_bytes))
        with pytest.raises(KVStoreError) as info:
            s.put(hs, ks[:5], pages(5, LAYOUT.page_bytes))
        assert info.value.code == CODE.RESOURCE_EXHAUSTED
        assert "'small'" in info.value.message and "quota of 1.0 MiB" in info.value.message
        assert s.put(hs, ks[:4], pages(4, LAYOUT.page_bytes)).stored == 4
        lease = s.lookup_lease(hs, ks[:4], lease_ms=60_000)
        with pytest.raises(KVStoreError) as info:
            s.put(hs, ks[4:5], pages(1, LAYOUT.page_bytes))
        assert info.value.code == CODE.RESOURCE_EXHAUSTED
        assert "'small' is at its quota of 1.0 MiB: it holds 1.0 MiB" in info.value.message
        s.release_lease(lease)
        # At its quota, a tenant's new pages push out its own coldest ones only.
        assert s.put(hs, ks[4:6], pages(2, LAYOUT.page_bytes)).stored == 2
        assert sum(s.exists(hs, ks[:6])) == 4
        assert b.exists(hb, keys("bq", 4)) == [True] * 4
        tenants = {t.name: t for t in ops.stats().tenants}
        assert tenants["small"].used_bytes == 1 << 20 and tenants["small"].quota_bytes == 1 << 20
        assert tenants["small"].pages == 4 and tenants["b"].quota_bytes == 0
        b.delete(hb, keys("bq", 4))
        s.delete(hs, ks)


# -- reload ----------------------------------------------------------------------------

def works(srv, name: str) -> bool:
    with client(srv, name) as c:
        try:
            c.register_layout(LAYOUT)
            return True
        except KVStoreError as exc:
            assert exc.code == CODE.UNAUTHENTICATED
            return False


def test_sighup_reloads_the_auth_file(fresh_server, tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(auth_toml(a="", ops=""))
    srv = fresh_server(auth_file=str(path))
    assert works(srv, "a") and not works(srv, "b")
    path.write_text(auth_toml(b="", ops=""))           # b added, a removed
    srv.send_signal(signal.SIGHUP)
    wait_for(lambda: "auth reloaded" in srv.log(), "the reload")
    assert "1 tenants, 1 admins" in srv.log()
    assert works(srv, "b") and not works(srv, "a")
    path.write_text("[tenants.b\n")                     # broken: the old set stays
    srv.send_signal(signal.SIGHUP)
    wait_for(lambda: "auth reload failed" in srv.log(), "the failed reload")
    assert "keeping the 1 tenants and 1 admins" in srv.log()
    assert works(srv, "b") and not works(srv, "a")
    assert srv.proc.poll() is None


def test_a_revoked_token_stops_working_on_an_open_lookup_stream(fresh_server, tmp_path):
    """LookupStream checks the caller at every request, not only when it opens."""
    path = tmp_path / "auth.toml"
    path.write_text(auth_toml(a="", ops=""))
    srv = fresh_server(auth_file=str(path))
    with client(srv, "a", data_plane=False) as c:       # the fast path: test_fastpath.py
        ns = c.register_layout(LAYOUT)
        assert c.lookup(ns, [b"k" * 16]) == 0 and c.lookup_stream.opened == 1
        path.write_text(auth_toml(b="", ops=""))       # a removed
        srv.send_signal(signal.SIGHUP)
        wait_for(lambda: "auth reloaded" in srv.log(), "the reload")
        with pytest.raises(KVStoreError) as err:
            c.lookup(ns, [b"k" * 16])
        assert err.value.code == CODE.UNAUTHENTICATED


def test_sighup_without_auth_file_is_harmless(fresh_server):
    srv = fresh_server()
    srv.send_signal(signal.SIGHUP)
    wait_for(lambda: "nothing to reload" in srv.log(), "the SIGHUP log line")
    with KVStoreClient(srv.address) as c:
        assert c.stats().version                       # Admin open without auth


# -- the listen-address guard --------------------------------------------------------
def test_non_loopback_listen_needs_auth_or_insecure_listen(fresh_server, tmp_path):
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore_server.main", "--listen", f"0.0.0.0:{port}",
         "--dram", "64MiB"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "not loopback" in proc.stderr and "--insecure-listen" in proc.stderr
    assert "--auth-file" in proc.stderr

    srv = fresh_server(insecure_listen="true", port=port, listen=f"0.0.0.0:{port}")
    assert "with no auth (--insecure-listen)" in srv.log()
    srv.stop()

    path = tmp_path / "auth.toml"
    path.write_text(auth_toml(a=""))
    port = free_port()
    srv = fresh_server(port=port, listen=f"0.0.0.0:{port}", auth_file=str(path))
    assert "TLS is off" in srv.log()
    assert works(srv, "a")


def test_bad_auth_file_stops_the_start(tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text('[tenants.a]\ntoken_sha256 = "nothex"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore_server.main", "--listen", f"127.0.0.1:{free_port()}",
         "--dram", "64MiB", "--auth-file", str(path)],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "[tenants.a]" in proc.stderr and "64 hex digits" in proc.stderr


# -- the admin CLI and the connector ------------------------------------------------------
def admin(srv, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_TOKEN"} | (env or {})
    return subprocess.run([sys.executable, "-m", "kvstore_client.admin_cli",
                           "--server", srv.address, *args], capture_output=True, text=True,
                          timeout=60, check=False, env=env, stdin=subprocess.DEVNULL)


def test_admin_cli_token(srv):
    proc = admin(srv, "--token", TOKENS["ops"], "stats", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["version"]
    proc = admin(srv, "layouts", env={"KVSTORE_TOKEN": TOKENS["ops"]})
    assert proc.returncode == 0, proc.stderr
    proc = admin(srv, "stats")
    assert proc.returncode == 1 and "UNAUTHENTICATED" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = admin(srv, "--token", TOKENS["a"], "stats")
    assert proc.returncode == 1 and "PERMISSION_DENIED" in proc.stderr
    assert admin(srv, "health").returncode == 0     # health needs no token


def test_connector_sends_its_token(srv):
    for token, ok in ((TOKENS["a"], True), ("", False)):
        sched = SchedulerHalf(ConnectorConfig(server=srv.address, token=token, lookup_timeout=5,
                                              lookups=LookupMode.SYNC),
                              [LAYOUT], block_size=16)
        try:
            if ok:
                assert sched.store.handles()[0].layout_id == LAYOUT.layout_id
            else:
                with pytest.raises(KVStoreError) as info:
                    sched.store.handles()
                assert info.value.code == CODE.UNAUTHENTICATED
        finally:
            sched.client.close()
