"""The CALL frame's body (kvstore_protocol.carriage) and what the server carries in it:
names round-trip, malformed bodies are WireError(INVALID) before anything is parsed, and
the carried set holds only unary KVStore calls, none with a frame of its own and neither
of the calls a restart's mend makes."""

from __future__ import annotations

import pytest

from kvstore_protocol import carriage as ca, fastwire as fw
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore_server.rpc.service import KVStoreService


def test_a_call_round_trips():
    request = pb.RetainRequest(session="s", ttl_ms=5).SerializeToString()
    body = ca.encode_call("Retain", request)
    assert len(body) <= ca.call_body_bytes(len(request))
    assert ca.decode_call(memoryview(body)) == ("Retain", request)
    assert ca.decode_call(ca.encode_call("Limits", b"")) == ("Limits", b"")


@pytest.mark.parametrize("body", [b"", b"\x00", b"\x00x", bytes((ca.MAX_NAME + 1,)) + b"a" * 65,
                                  b"\x05abc", b"\x03a-b", b"\x03\xc3\xa9x", b"\x021x"])
def test_a_malformed_body_is_invalid(body):
    with pytest.raises(fw.WireError) as err:
        ca.decode_call(body)
    assert err.value.status is fw.Status.INVALID


@pytest.mark.parametrize("name", ["", "x" * (ca.MAX_NAME + 1), "Ré"])
def test_a_name_that_cannot_be_sent_is_refused_at_the_client(name):
    with pytest.raises((ValueError, UnicodeEncodeError)):
        ca.encode_call(name, b"")


def test_the_carried_set_is_cold_unary_kvstore_calls():
    carried = KVStoreService.CARRIED
    assert all(ca.messages(m) is not None for m in carried)
    # A frame of its own, or a restart's mend: never carried.
    assert not carried & {"Lookup", "Exists", "Delete", "Acquire", "Reserve", "Commit",
                          "Abort", "ReleaseLease", "Attach", "RegisterLayout"}
    assert ca.messages("Get") is None and ca.messages("LookupStream") is None
    assert ca.service_call("Get") and not ca.service_call("Evict")
    assert ca.admin_call("Evict") and not ca.admin_call("Retain")
