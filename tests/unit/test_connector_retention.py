"""A request's retention ask in kv_transfer_params (connector.scheduler.retention): what parses, and
why the rest is refused (the request is served either way)."""

from __future__ import annotations

import pytest

from connector.scheduler.retention import MAX_TTL_S, RetainAsk, ask_of


def test_no_ask():
    assert ask_of(None) is None
    assert ask_of({}) is None
    assert ask_of({"do_remote_prefill": True}) is None     # another connector's keys


def test_retain_and_release():
    assert ask_of({"kvstore_retain": {"session": "agent-1", "ttl_s": 600}}) == \
        RetainAsk("agent-1", 600.0)
    assert ask_of({"kvstore_retain": {"session": "agent-1", "ttl_s": 0.5}}).ttl_s == 0.5
    assert ask_of({"kvstore_retain": {"session": "agent-1", "release": True}}) == \
        RetainAsk("agent-1", release=True)


@pytest.mark.parametrize("value, why", [
    ("agent-1", "an object"),
    ({"ttl_s": 60}, "session"),
    ({"session": "", "ttl_s": 60}, "session"),
    ({"session": "x" * 257, "ttl_s": 60}, "session"),
    ({"session": 7, "ttl_s": 60}, "session"),
    ({"session": "s"}, "ttl_s"),
    ({"session": "s", "ttl_s": 0}, "ttl_s"),
    ({"session": "s", "ttl_s": -1}, "ttl_s"),
    ({"session": "s", "ttl_s": MAX_TTL_S + 1}, "ttl_s"),
    ({"session": "s", "ttl_s": "60"}, "ttl_s"),
    ({"session": "s", "ttl_s": True}, "ttl_s"),
    ({"session": "s", "ttl_s": float("nan")}, "ttl_s"),
    ({"session": "s", "ttl_s": 60, "pages": 3}, "unknown"),
])
def test_malformed_asks_say_why(value, why):
    with pytest.raises(ValueError, match=why):
        ask_of({"kvstore_retain": value})
