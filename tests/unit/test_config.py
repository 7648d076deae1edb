import pytest

from kvstore_protocol.units import format_size, parse_duration, parse_size
from kvstore_server.config import ConfigError, load_config


def test_units():
    assert parse_size("512MiB") == 512 << 20 and parse_size("4GiB") == 4 << 30
    assert parse_size("1.5G") == 1_500_000_000 and parse_size(42) == 42
    assert parse_duration("2s") == 2 and parse_duration("500ms") == 0.5
    assert parse_duration("1m") == 60
    for bad in ("", "12 parsecs", "-1", "MiB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_duration("soon")
    assert format_size(3 << 30) == "3.0 GiB"


def test_defaults():
    c = load_config([], environ={})
    assert c.listen == "127.0.0.1:50051" and c.lease_ttl == 30 and c.disk == 0
    assert c.stream_timeout == 30
    assert load_config(["--stream-timeout", "1500ms"], environ={}).stream_timeout == 1.5
    assert load_config([], environ={"KVSTORE_STREAM_TIMEOUT": "0"}).stream_timeout == 0


def test_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text('dram = "256MiB"\nlease-ttl = "5s"\nmetrics_port = 9100\n'
                    'listen = "127.0.0.1:7000"\n')
    env = {"KVSTORE_LEASE_TTL": "7s", "KVSTORE_METRICS_PORT": "9200"}
    c = load_config(["--config", str(path), "--metrics-port", "9300"], environ=env)
    assert c.dram == 256 << 20            # file
    assert c.lease_ttl == 7.0             # environment beats file
    assert c.metrics_port == 9300         # flag beats environment
    assert c.listen == "127.0.0.1:7000"


@pytest.mark.parametrize("argv,words", [
    (["--dram", "lots"], "dram"),
    (["--dram", "1MiB"], "at least"),
    (["--lease-ttl", "0s"], "lease_ttl"),
    (["--stream-timeout=-1s"], "stream_timeout"),
    (["--lookup-streams=-1"], "lookup_streams"),
    (["--disk", "1GiB"], "disk_dir"),
    (["--listen", "nowhere"], "HOST:PORT"),
    (["--high-watermark", "0.5", "--low-watermark", "0.9"], "watermarks"),
    (["--max-keys-per-request", "100000000000"], "max_keys_per_request must be 1 to"),
    (["--lease-memory=-1"], "lease_memory"),
    (["--max-layouts", "0"], "max_layouts"),
    (["--data-congestion", "Bad Name"], "data_congestion"),
    (["--data-congestion", "x" * 16], "data_congestion"),
])
def test_bad_values_name_the_setting(argv, words):
    with pytest.raises(ConfigError, match=words):
        load_config(argv, environ={})


def test_bad_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("dram = \n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--config", str(path)], environ={})
    path.write_text('colour = "blue"\n')
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        load_config(["--config", str(path)], environ={})


@pytest.mark.parametrize("line,words", [
    ("workers = true", "True is a boolean"),             # TOML's true is an int to Python
    ("disk = true", "True is a boolean"),
    ("metrics_port = 0.9", "0.9 is not a whole number"),  # it truncated to 0: metrics off
    ("lease_ttl = inf", "not a finite number"),           # a client lease never expiring
    ("stream_timeout = nan", "not a finite number"),      # the watchdog off
    ("high_watermark = nan", "not a finite number"),
])
def test_values_a_file_may_not_hold(tmp_path, line, words):
    path = tmp_path / "kvstore.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=words):
        load_config(["--config", str(path)], environ={})
    path.write_text("workers = 4.0\n")                    # a whole number is one
    assert load_config(["--config", str(path)], environ={}).workers == 4


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('log_level = "INFO" # caf\xe9\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"cannot read config file .*utf-8"):
        load_config(["--config", str(path)], environ={})


def test_the_example_deploy_config_loads():
    import pathlib
    example = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "kvstore.toml"
    c = load_config(["--config", str(example)], environ={})
    assert c.dram == 64 << 30 and c.disk == 512 << 30 and c.flush_on_stop
    assert c.metrics_port == 9464 and c.disk_dir == "/var/lib/kvstore"
