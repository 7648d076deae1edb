"""Auth file parsing, token checks, tenant scoping, quotas and lease ownership in-process.
The same behaviour over gRPC against a real server: tests/integration/test_auth.py."""

import hashlib
import logging
import os
import threading

import numpy as np
import pytest

from kvstore_protocol.layout import PageLayout
from kvstore_server.auth import Authenticator, Principal, Role, parse_auth_file
from kvstore_server.config import ConfigError, is_loopback, load_config
from kvstore_server.errors import Outcome, StoreError
from kvstore_server.region import Region
from kvstore_server.store import FOREVER, Store
from kvstore_server.store.leases import footprint
from kvstore_server.store.stats import TenantStats
from kvstore_server.tenants import DEFAULT_TENANT, scoped_layout_id

MiB = 1 << 20
LAYOUT = PageLayout(model="t", num_layers=4, page_tokens=16, num_kv_heads=8, head_size=128)
PAGE = LAYOUT.page_bytes      # 256 KiB


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(token: str) -> list[tuple[str, str]]:
    return [("user-agent", "test"), ("authorization", f"Bearer {token}")]


GOOD = f"""
[tenants.team-a]
token_sha256 = "{sha('tok-a')}"
quota = "8GiB"
shared_memory = true

[tenants.team-b]
token_sha256 = ["{sha('tok-b')}", "{sha('tok-b2')}"]

[admins.ops]
token_sha256 = "{sha('tok-admin').upper()}"
"""


@pytest.fixture
def auth_file(tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(GOOD)
    return path


def test_parse_good_file(auth_file):
    principals = parse_auth_file(str(auth_file)).tokens
    a = principals[hashlib.sha256(b"tok-a").digest()]
    assert a == Principal("team-a", Role.TENANT, 8 << 30, True)
    b = principals[hashlib.sha256(b"tok-b").digest()]
    assert b == principals[hashlib.sha256(b"tok-b2").digest()]     # two tokens: rotation
    assert (b.quota_bytes, b.shared_memory) == (0, False)
    assert principals[hashlib.sha256(b"tok-admin").digest()].role is Role.ADMIN


@pytest.mark.parametrize("text,words", [
    ('[tenants.a]\ntoken_sha256 = "abc"\n', ["[tenants.a]", "64 hex digits"]),
    ('[tenants.a]\nquota = "1GiB"\n', ["[tenants.a]", "token_sha256 is missing",
                                       "cert_sha256"]),
    ('[tenants.a]\ncert_sha256 = "ab:cd"\n', ["[tenants.a]", "cert_sha256", "64 hex"]),
    (f'[tenants.a]\ncert_sha256 = "{sha("c")}"\n[admins.b]\ncert_sha256 = "{sha("c")}"\n',
     ["[admins.b]", "certificate", "unique"]),
    (f'[tenants.a]\ntoken_sha256 = "{sha("x")}"\ncolour = 1\n', ["[tenants.a]", "colour"]),
    (f'[admins.o]\ntoken_sha256 = "{sha("x")}"\nquota = "1GiB"\n', ["[admins.o]", "quota"]),
    (f'[tenants.a]\ntoken_sha256 = "{sha("x")}"\nquota = "lots"\n', ["[tenants.a]", "quota"]),
    (f'[tenants.a]\ntoken_sha256 = "{sha("x")}"\nshared_memory = "yes"\n', ["shared_memory"]),
    (f'[tenants."a b"]\ntoken_sha256 = "{sha("x")}"\n', ["a name is"]),
    (f'[tenants.a]\ntoken_sha256 = "{sha("x")}"\n[admins.b]\ntoken_sha256 = "{sha("x")}"\n',
     ["[admins.b]", "unique"]),
    (f'[users.a]\ntoken_sha256 = "{sha("x")}"\n', ["unknown table", "users"]),
    ("", ["no [tenants.NAME]"]),
    ("[tenants.a\n", ["cannot read"]),
])
def test_bad_files_name_file_and_entry(tmp_path, text, words):
    path = tmp_path / "auth.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        parse_auth_file(str(path))
    for word in [str(path), *words]:
        assert word in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read auth file"):
        Authenticator(str(tmp_path / "nope.toml"))


def test_principal_of_metadata(auth_file):
    auth = Authenticator(str(auth_file))
    assert auth.principal(bearer("tok-a")).name == "team-a"
    assert auth.principal([("authorization", "bearer tok-b2")]).name == "team-b"
    assert auth.principal(bearer("tok-admin")).role is Role.ADMIN
    for metadata in ([], None, [("authorization", "Basic dXNlcg==")],
                     [("authorization", "Bearer ")]):
        with pytest.raises(StoreError, match="missing bearer token") as info:
            auth.principal(metadata)
        assert info.value.outcome is Outcome.UNAUTHENTICATED
    with pytest.raises(StoreError, match="invalid token") as info:
        auth.principal(bearer("tok-c"))
    assert info.value.outcome is Outcome.UNAUTHENTICATED
    assert auth.counts() == (2, 1)
    assert auth.quotas() == {"team-a": 8 << 30, "team-b": 0}


def test_reload_swaps_or_keeps(auth_file, caplog):
    auth = Authenticator(str(auth_file))
    auth_file.write_text(f'[tenants.team-c]\ntoken_sha256 = "{sha("tok-c")}"\n')
    with caplog.at_level(logging.INFO, logger="kvstore_server.auth"):
        assert auth.reload()
    assert "1 tenants, 0 admins" in caplog.text
    assert auth.principal(bearer("tok-c")).name == "team-c"
    with pytest.raises(StoreError):
        auth.principal(bearer("tok-a"))
    auth_file.write_text("[tenants.team-d\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvstore_server.auth"):
        assert not auth.reload()
    assert "keeping the 1 tenants and 0 admins" in caplog.text and "cannot read" in caplog.text
    assert auth.principal(bearer("tok-c")).name == "team-c"


def test_reload_of_a_file_that_cannot_be_read_keeps_the_old_one(auth_file, caplog):
    """Not UTF-8: a traceback from the reloader and no "reload failed" line. A FIFO: each
    SIGHUP's reload blocked in open() holding the reload lock, so no later good file was
    ever read, and the stop hung on the reloader threads."""
    auth = Authenticator(str(auth_file))
    good = auth_file.read_bytes()
    auth_file.write_bytes(b'[tenants.caf\xe9]\ntoken_sha256 = "00"\n')
    with caplog.at_level(logging.INFO, logger="kvstore_server.auth"):
        assert not auth.reload()
    assert "auth reload failed" in caplog.text and "utf-8" in caplog.text
    auth_file.unlink()
    os.mkfifo(auth_file)
    done = threading.Event()
    threading.Thread(target=lambda: (auth.reload(), done.set()), daemon=True).start()
    assert done.wait(5), "the reload of a FIFO blocked"
    assert "not a regular file" in caplog.text
    assert auth.principal(bearer("tok-a")).name == "team-a"
    auth_file.unlink()
    auth_file.write_bytes(good)
    assert auth.reload()


def test_scoped_layout_ids():
    lid = LAYOUT.layout_id
    assert scoped_layout_id(DEFAULT_TENANT, lid) == lid          # no auth: ids unchanged
    a, b = scoped_layout_id("a", lid), scoped_layout_id("b", lid)
    assert len(a) == len(b) == 16 and len({a, b, lid}) == 3
    assert scoped_layout_id("a", lid) == a                        # stable across restarts
    assert scoped_layout_id("ab", lid[1:] + b"x") != scoped_layout_id("a", b"b" + lid[1:])


# -- listen address checks ------------------------------------------------------------
@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("[::1]", True),
    ("0.0.0.0", False), ("[::]", False), ("10.1.2.3", False), ("store.example", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_non_loopback_listen_needs_auth_or_a_flag():
    with pytest.raises(ConfigError, match="--insecure-listen") as info:
        load_config(["--listen", "0.0.0.0:50051"], environ={})
    assert "--auth-file" in str(info.value)
    assert load_config(["--listen", "0.0.0.0:1", "--insecure-listen"], environ={}).insecure_listen
    assert load_config(["--listen", "0.0.0.0:1"],
                       environ={"KVSTORE_INSECURE_LISTEN": "true"}).insecure_listen
    assert load_config(["--listen", "0.0.0.0:1", "--auth-file", "a.toml"], environ={})
    assert load_config(["--listen", "0.0.0.0:1", "--tls-cert", "c", "--tls-key", "k",
                        "--tls-client-ca", "ca"], environ={})
    with pytest.raises(ConfigError, match="--insecure-listen"):   # TLS alone: no auth
        load_config(["--listen", "0.0.0.0:1", "--tls-cert", "c", "--tls-key", "k"], environ={})
    with pytest.raises(ConfigError, match="both tls_cert and tls_key"):
        load_config(["--tls-cert", "c"], environ={})
    with pytest.raises(ConfigError, match="needs TLS"):
        load_config(["--tls-client-ca", "ca"], environ={})


# -- the store: namespaces, quotas, lease ownership ------------------------------------
@pytest.fixture
def store():
    region = Region(16 * MiB)
    yield Store(region, lease_ttl=5.0)
    region.close()


def keys(prefix, n):
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def put(store, layout_id, ks, quota=0, tenant=None):
    res = store.reserve(layout_id, ks, quota=quota)
    return store.commit(res.lease_id, tenant)


def test_tenants_get_disjoint_namespaces(store):
    a = store.register_layout(LAYOUT, "a")
    b = store.register_layout(LAYOUT, "b")
    assert a.layout_id != b.layout_id and a.tenant == "a"
    assert store.register_layout(LAYOUT).layout_id == LAYOUT.layout_id
    put(store, a.layout_id, keys("k", 3))
    assert store.exists(b.layout_id, keys("k", 3)).tolist() == [False] * 3
    assert store.lookup([a.layout_id], keys("k", 3))[0] == 3


def test_quota_evicts_only_the_tenants_own_pages(store):
    a = store.register_layout(LAYOUT, "a")
    b = store.register_layout(LAYOUT, "b")
    put(store, b.layout_id, keys("b", 4))
    quota = 4 * PAGE
    put(store, a.layout_id, keys("a", 4), quota)
    assert store.stats().tenants[0] == TenantStats("a", pages=4, used_bytes=4 * PAGE)
    put(store, a.layout_id, keys("x", 2), quota)          # evicts a's two coldest: the tail
    assert store.exists(a.layout_id, keys("a", 4)).tolist() == [True, True, False, False]
    assert store.exists(b.layout_id, keys("b", 4)).all()
    by_name = {t.name: t for t in store.stats().tenants}
    assert by_name["a"].used_bytes == 4 * PAGE and by_name["b"].used_bytes == 4 * PAGE
    # More than the whole quota at once, or only leased pages to give up: refused.
    with pytest.raises(StoreError, match="more than its whole quota") as info:
        store.reserve(a.layout_id, keys("y", 5), quota=quota)
    assert info.value.outcome is Outcome.EXHAUSTED
    pinned = store.acquire(a.layout_id, keys("a", 2) + keys("x", 2))
    with pytest.raises(StoreError, match=r"'a' is at its quota of 1\.0 MiB: it holds 1\.0 MiB"):
        store.reserve(a.layout_id, keys("y", 1), quota=quota)
    assert store.exists(b.layout_id, keys("b", 4)).all()
    store.release(pinned.lease_id)
    put(store, a.layout_id, keys("y", 1), quota)


def test_a_tenant_at_its_quota_evicts_a_batch_not_a_page_per_put():
    """Each reserve over the quota scans every slot for victims, so it evicts up to
    QUOTA_BATCH of the quota beyond its need (whole pages): the next puts find room."""
    from kvstore_server.store.quota import QUOTA_BATCH
    small = PageLayout(model="q", num_layers=1, page_tokens=1, num_kv_heads=1,
                       head_size=1024, dtype="float16")                   # 4 KiB pages
    region = Region(16 * MiB)
    try:
        store = Store(region)
        a = store.register_layout(small, "a")
        quota = 256 * 4096
        batch = int(256 * QUOTA_BATCH)                          # 8 pages
        put(store, a.layout_id, keys("a", 256), quota)

        def pages():
            return store.stats().tenants[0].pages

        put(store, a.layout_id, keys("x", 1), quota)       # 1 needed, 8 more in the batch
        assert pages() == 256 - batch
        assert store.exists(a.layout_id, keys("a", 256)).tolist() == \
            [True] * (256 - batch - 1) + [False] * (batch + 1)   # the coldest: the tail
        evictions = store.stats().evictions
        put(store, a.layout_id, keys("y", batch), quota)   # fits in the room the batch made
        assert store.stats().evictions == evictions and pages() == 256
    finally:
        region.close()


def test_usage_is_refunded_on_every_way_out(store):
    a = store.register_layout(LAYOUT, "a")

    def used():
        return store.stats().tenants[0].used_bytes

    res = store.reserve(a.layout_id, keys("w", 2))          # WRITING counts
    assert used() == 2 * PAGE
    store.abort(res.lease_id)
    assert used() == 0
    put(store, a.layout_id, keys("k", 3))
    pinned = store.acquire(a.layout_id, keys("k", 1))
    store.delete(a.layout_id, keys("k", 3))                 # the leased one is DOOMED
    assert used() == PAGE
    store.release(pinned.lease_id)
    assert used() == 0
    put(store, a.layout_id, keys("k", 3))
    store.evict(everything=True)
    assert used() == 0
    put(store, a.layout_id, keys("k", 3))
    store.clear()
    assert used() == 0


def test_leases_belong_to_their_tenant(store):
    a = store.register_layout(LAYOUT, "a")
    put(store, a.layout_id, keys("k", 2))
    _, lease = store.lookup([a.layout_id], keys("k", 2), lease_ttl=5.0)
    assert not store.release(lease, "b") and store.release(lease, "a")
    res = store.reserve(a.layout_id, keys("n", 1))
    with pytest.raises(StoreError, match="unknown or has expired"):
        store.commit(res.lease_id, "b")
    assert not store.abort(res.lease_id, "b")
    assert store.commit(res.lease_id, "a") == 1
    assert np.all(store.exists(a.layout_id, keys("n", 1)))


def test_a_stream_lease_is_out_of_every_clients_reach(store):
    """A Put or Get stream's lease (it never expires) is ended by the server alone, not by
    a client of its tenant: a client that aborted one let the slot be reused mid-write."""
    a = store.register_layout(LAYOUT, "a")
    res = store.reserve(a.layout_id, keys("w", 1), ttl=FOREVER)
    with pytest.raises(StoreError, match="unknown or has expired"):
        store.commit(res.lease_id, "a")
    assert not store.abort(res.lease_id, "a") and not store.release(res.lease_id, "a")
    put(store, a.layout_id, keys("r", 1))
    pinned = store.acquire(a.layout_id, keys("r", 1), ttl=FOREVER)
    assert not store.release(pinned.lease_id, "a")
    assert store.commit(res.lease_id) == 1 and store.release(pinned.lease_id)


def test_leases_past_lease_memory_are_not_given(store):
    """Past lease_memory a leased lookup counts without a lease, Acquire and Reserve are
    refused; a stream's lease still goes, and an ended lease makes room again."""
    a = store.register_layout(LAYOUT, "a")
    put(store, a.layout_id, keys("k", 1))
    store.lease_memory = footprint(40) * 3 // 2      # room for one lease of 40
    one = keys("k", 1) * 40                     # one page named 40 times
    count, first = store.lookup([a.layout_id], one, lease_ttl=5.0)
    assert count == 40 and first
    assert store.lookup([a.layout_id], one, lease_ttl=5.0) == (40, 0)
    with pytest.raises(StoreError, match="--lease-memory") as refused:
        store.acquire(a.layout_id, one)
    assert refused.value.outcome is Outcome.EXHAUSTED
    with pytest.raises(StoreError, match="--lease-memory"):
        store.reserve(a.layout_id, keys("n", 40))
    streamed = store.acquire(a.layout_id, one, ttl=FOREVER)
    assert store.release(streamed.lease_id) and store.release(first, "a")
    last = store.lookup([a.layout_id], one, lease_ttl=5.0)[1]
    assert last and store.release(last, "a")
    assert store.stats().pinned_pages == 0      # nothing pinned by the refusals


def test_lease_ids_cannot_be_guessed_from_one_another(store):
    a = store.register_layout(LAYOUT, "a")
    put(store, a.layout_id, keys("k", 1))
    ids = [store.lookup([a.layout_id], keys("k", 1), lease_ttl=5.0)[1] for _ in range(200)]
    assert len(set(ids)) == 200 and all(0 < i < 1 << 63 for i in ids)
    # Counted ids were one apart; random 63-bit ones this close happen once in ~2^40.
    gaps = np.abs(np.diff(np.array(ids, dtype=np.float64)))
    assert gaps.min() > 1 << 20


# -- client certificates as identities --------------------------------------------------
CERT_A, CERT_B, CERT_X = (hashlib.sha256(name).digest() for name in (b"a", b"b", b"x"))


def colons(digest: bytes) -> str:
    """As `openssl x509 -fingerprint -sha256` prints it."""
    return ":".join(f"{b:02X}" for b in digest)


@pytest.fixture
def cert_auth(tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(f"""
[tenants.team-a]
cert_sha256 = "{colons(CERT_A)}"
[tenants.team-b]
token_sha256 = "{sha('tok-b')}"
cert_sha256 = ["{CERT_B.hex()}", "{sha('old-b')}"]
[admins.ops]
cert_sha256 = "{CERT_X.hex().upper()}"
""")
    return path


def test_a_certificate_names_its_caller_and_a_token_must_agree(cert_auth):
    auth = Authenticator(str(cert_auth))
    tok_b = hashlib.sha256(b"tok-b").digest()
    assert auth.identify(None, CERT_A).name == "team-a"          # no token needed
    assert auth.identify(None, CERT_X).role is Role.ADMIN
    assert auth.identify(tok_b, CERT_B).name == "team-b"         # both, one caller
    assert auth.identify(tok_b, None).name == "team-b"
    assert auth.identify(tok_b, hashlib.sha256(b"unknown").digest()).name == "team-b"
    refusals = [
        (None, None, "missing bearer token"),
        (None, hashlib.sha256(b"unknown").digest(), "not named in the auth file"),
        (tok_b, CERT_A, ("the bearer token names tenant 'team-b' and the client "
                         "certificate tenant 'team-a'")),
        (hashlib.sha256(b"nope").digest(), CERT_A, "invalid token"),   # never ignored
    ]
    for token, cert, words in refusals:
        with pytest.raises(StoreError, match=words) as info:
            auth.identify(token, cert)
        assert info.value.outcome is Outcome.UNAUTHENTICATED
    assert auth.counts() == (2, 1) and auth.certificates() == 4


def test_reload_revokes_a_certificate(cert_auth):
    auth = Authenticator(str(cert_auth))
    cert_auth.write_text(f'[tenants.team-b]\ncert_sha256 = "{CERT_B.hex()}"\n')
    assert auth.reload()
    with pytest.raises(StoreError, match="not named in the auth file"):
        auth.identify(None, CERT_A)
    assert auth.identify(None, CERT_B).name == "team-b"
