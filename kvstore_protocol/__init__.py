"""What the server and its clients must agree on, in one place: the wire contract.

Both ends import this package; it imports neither of them (nor anything of ours), so the
daemon does not load the client library and a client does not load the server.

    _proto/         the gRPC messages and services, generated from proto/ by
                    scripts/gen_protos.py (never edited by hand; a test checks it is current)
    grpc_frames.py  the gRPC path's bulk bytes: Put and Get data messages framed by hand,
                    and the channel options both ends use
    convert.py      PageLayout <-> its protobuf message
    fastwire.py     the fast path's frames: header, ops, bodies, bounds, status codes
    keys.py         page keys packed for the wire (Packed), and their bounds
    layout.py       PageLayout and its layout id (the canonical encoding both ends hash)
    reasons.py      Reason: why a call failed, where the caller must react
    region.py       the shared region's header: magic, token, hand-out socket, region id
    presence_map.py the presence map's format and bucket formula
    units.py        sizes and durations as people write them ("64GiB", "30s")
    malloc.py       the allocator setting every process that receives pages over gRPC wants

The old paths under kvstore_client (kvstore_client.keys, ...) still import, for one
release (kvstore_client/moved.py).
"""
