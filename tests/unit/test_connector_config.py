"""ConnectorConfig.from_mapping: the lookup settings arrive typed, bad values are named."""

from __future__ import annotations

import pytest

from kvstore_connector.config import ConnectorConfig, LookupMode


def test_lookups_default_to_prefetch_and_every_hit_counts():
    config = ConnectorConfig.from_mapping({})
    assert config.lookups is LookupMode.PREFETCH
    assert config.lookup_wait_ms == 2.0 and config.min_hit_tokens == 0


def test_lookup_settings_from_json():
    config = ConnectorConfig.from_mapping({"lookups": "sync", "lookup_wait_ms": 0,
                                           "min_hit_tokens": 256})
    assert config.lookups is LookupMode.SYNC
    assert config.lookup_wait_ms == 0 and config.min_hit_tokens == 256


@pytest.mark.parametrize(("values", "words"), [
    ({"lookups": "eager"}, "'eager' is not a valid LookupMode"),
    ({"lookup_wait_ms": -1}, "lookup_wait_ms >= 0"),
    ({"min_hit_tokens": -16}, "min_hit_tokens and remote_min_hit_tokens >= 0"),
    ({"remote_min_hit_tokens": -16}, "remote_min_hit_tokens >= 0"),
])
def test_bad_lookup_settings_are_named(values, words):
    with pytest.raises(ValueError, match=words):
        ConnectorConfig.from_mapping(values)


def test_fields_of_a_mixed_mapping_are_ours_and_the_rest_the_engines():
    """SGLang's extra config holds its own keys beside ours: ours are every field of
    ConnectorConfig, with no list of them kept anywhere else."""
    extra = {"backend_name": "kvstore", "interface_v1": True, "server": "h:1",
             "model_revision": "r1", "remote_connections": 3}
    assert ConnectorConfig.fields_of(extra) == {"server": "h:1", "model_revision": "r1",
                                                "remote_connections": 3}
    every = {f: getattr(ConnectorConfig(), f) for f in ConnectorConfig.__dataclass_fields__}
    assert ConnectorConfig.fields_of({**every, "backend_name": "kvstore"}) == every


def test_a_congestion_control_the_host_lacks_stops_the_start_with_the_setting_named():
    with pytest.raises(ValueError, match="data_congestion: this kernel has no TCP "
                                         "congestion control 'nosuch'"):
        ConnectorConfig.from_mapping({"data_congestion": "nosuch"})
