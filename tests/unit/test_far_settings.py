"""The --far* settings: flags, environment and TOML as for every setting, and a clear
message for each bad value."""

from __future__ import annotations

import pytest

from kvstore_server.config import ConfigError, load_config
from kvstore_server.far.settings import ClusterMode, WritePolicy, from_config, parse_far


def test_no_far_by_default():
    assert from_config(load_config([], environ={})) is None


def test_flags():
    c = load_config(["--far", "redis://a:7000,redis://b:7001", "--far-cluster", "on",
                     "--far-ttl", "10m", "--far-timeout", "20ms", "--far-write", "through",
                     "--far-namespace", "fleet1", "--far-queue", "64MiB",
                     "--far-insecure"], environ={})
    s = from_config(c)
    assert s.nodes == (("a", 7000), ("b", 7001)) and not s.tls
    assert s.cluster is ClusterMode.ON and s.write is WritePolicy.THROUGH
    assert (s.ttl, s.timeout, s.namespace, s.queue_bytes) == (600, 0.02, "fleet1", 64 << 20)


def test_the_removal_watch_from_flags_toml_and_its_defaults(tmp_path):
    s = parse_far("valkey://h")
    assert (s.watch_pages, s.watch_round, s.watch_interval) == (65536, 16384, 1.0)
    c = load_config(["--far", "redis://h", "--far-insecure", "--far-watch-pages", "1000",
                     "--far-watch-round", "100", "--far-watch-interval", "250ms"], environ={})
    s = from_config(c)
    assert (s.watch_pages, s.watch_round, s.watch_interval) == (1000, 100, 0.25)
    toml = tmp_path / "kv.toml"
    toml.write_text('far = "redis://h"\nfar-insecure = true\nfar-watch-pages = 64\n'
                    'far-watch-round = 64\nfar-watch-interval = "5s"\n')
    s = from_config(load_config(["--config", str(toml)], environ={}))
    assert (s.watch_pages, s.watch_round, s.watch_interval) == (64, 64, 5.0)


def test_defaults_are_tens_of_ms_and_evict():
    s = parse_far("valkey://h")
    assert s.nodes == (("h", 6379),) and s.timeout == 0.05 and s.write is WritePolicy.EVICT
    assert s.cluster is ClusterMode.AUTO and s.ttl == 0


def test_environment_and_toml(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text('far = "rediss://h:7000"\nfar-write = "off"\nfar-insecure = true\n')
    s = from_config(load_config(["--config", str(toml)],
                                environ={"KVSTORE_FAR_TIMEOUT": "30ms"}))
    assert s.tls and s.write is WritePolicy.OFF and s.timeout == 0.03


def test_credentials_from_url_and_file(tmp_path):
    s = parse_far("redis://alice:s%40cret@h:7000")
    assert (s.username, s.password) == ("alice", "s@cret")
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    s = parse_far("redis://alice@h:7000", password_file=str(secret))
    assert (s.username, s.password) == ("alice", "from-file")
    assert "from-file" not in repr(s) and "s@cret" not in repr(parse_far("redis://a:s%40cret@h"))


@pytest.mark.parametrize("argv, words", [
    (["--far", "http://h:1"], "scheme must be one of"),
    (["--far", "redis://"], "names no host"),
    (["--far", "redis://h:99999"], "bad port"),
    (["--far", "redis://h/3"], "only database 0"),
    (["--far", "redis://h:1,rediss://h:2"], "disagree"),
    (["--far", "redis://h", "--far-cluster", "maybe"], "auto/on/off"),
    (["--far", "redis://h", "--far-write", "sometimes"], "evict/through/off"),
    (["--far", "redis://h", "--far-timeout", "0"], "far_timeout"),
    (["--far", "redis://h", "--far-namespace", "a{b}"], "far_namespace"),
    (["--far", "redis://h", "--far-queue", "1KiB"], "far_queue"),
    (["--far", "redis://h", "--far-password-file", "/nonexistent/pw"], "password file"),
    (["--far", "redis://h", "--far-ca-file", "/etc/hostname"], "needs rediss"),
    (["--far", "rediss://h", "--far-ca-file", "/nonexistent/ca.pem"], "CA file"),
    (["--far", "rediss://h", "--far-ca-file", "/etc/hostname"], "no PEM certificate"),
    (["--far", "redis://h", "--far-watch-pages", "0"], "far_watch_pages must be 1 to"),
    (["--far", "redis://h", "--far-watch-pages", "many"], "far_watch_pages"),
    (["--far", "redis://h", "--far-watch-pages", "8", "--far-watch-round", "9"],
     r"far_watch_round must be 1 to far_watch_pages \(8\), got 9"),
    (["--far", "redis://h", "--far-watch-interval", "10ms"], "far_watch_interval"),
    (["--far", "redis://h", "--far-watch-interval", "2h"], "far_watch_interval"),
])
def test_bad_values_say_what_is_wrong(argv, words):
    with pytest.raises(ConfigError, match=words):
        load_config(argv, environ={})


def test_a_server_without_far_needs_no_far_client_library():
    """valkey-glide is imported only with --far: the server module loads without it."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['glide_sync'] = None\n"
            "import kvstore_server.main\n"
            "assert 'glide_sync' not in {m for m, v in sys.modules.items() if v}\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr


def test_a_far_tier_without_a_secret_is_refused_unless_insecure_is_chosen(tmp_path):
    with pytest.raises(ConfigError, match="needs --far-secret-file"):
        load_config(["--far", "redis://h"], environ={})
    s = from_config(load_config(["--far", "redis://h", "--far-insecure"], environ={}))
    assert not s.signed
    path = tmp_path / "secret"
    path.write_text("# the fleet's\n" + "ab" * 32 + "\n\n" + "cd" * 32 + "\n")
    s = from_config(load_config(["--far", "redis://h", "--far-secret-file", str(path)],
                                environ={}))
    assert s.signed and len(s.keys.keyring().by_id) == 2
    assert "ab" * 32 not in repr(s)
    with pytest.raises(ConfigError, match="contradict"):
        load_config(["--far", "redis://h", "--far-secret-file", str(path),
                     "--far-insecure"], environ={})


@pytest.mark.parametrize("text, words", [
    ("", "holds no secret"), ("# only a comment\n", "holds no secret"),
    ("short\n", "at least 32 bytes")])
def test_a_bad_secret_file_is_a_clear_error(tmp_path, text, words):
    path = tmp_path / "secret"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_config(["--far", "redis://h", "--far-secret-file", str(path)], environ={})
    with pytest.raises(ConfigError, match="No such file"):
        load_config(["--far", "redis://h", "--far-secret-file", str(tmp_path / "none")],
                    environ={})
