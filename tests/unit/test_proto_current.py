"""The checked-in generated protobuf code matches proto/ (scripts/gen_protos.py)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_current():
    pytest.importorskip("grpc_tools")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_wire_framing_matches_protobuf():
    from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
    from kvstore_protocol.grpc_frames import GET_DATA_TAG, PUT_DATA_TAG, frame, unframe

    for size in (0, 1, 127, 128, 300, 1 << 20):
        payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        framed = frame(GET_DATA_TAG, [payload[: size // 2], payload[size // 2:]])
        assert pb.GetResponse.FromString(framed).data == payload
        assert bytes(unframe(pb.GetResponse(data=payload).SerializeToString(),
                             GET_DATA_TAG)) == payload
        put = frame(PUT_DATA_TAG, [payload])
        assert pb.PutRequest.FromString(put).data == payload
    header = pb.PutRequest(header=pb.PutHeader(layout_id=b"x")).SerializeToString()
    assert unframe(header, PUT_DATA_TAG) is None
    assert unframe(b"\x0a\x05abc", GET_DATA_TAG) is None      # truncated
