"""Keys packed once (kvstore_protocol.keys.Packed) are taken by put and get_into as they
are, over the fast path and through the shared pool alike."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.buffers import page_aligned_empty
from kvstore_protocol.keys import Packed
from kvstore_testing.serverproc import ServerProcess

LAYOUT = PageLayout(model="fp-packed", num_layers=2, page_tokens=4, num_kv_heads=2,
                    head_size=16, dtype="int8")


@pytest.fixture(scope="module")
def srv():
    with ServerProcess(dram="64MiB") as server:
        yield server


@pytest.mark.parametrize("shared_memory", [False, None])
def test_packed_keys_put_and_get_into_are_byte_exact(srv, shared_memory):
    with KVStoreClient(srv.address, shared_memory=shared_memory) as c:
        assert (c.region() is None) == (shared_memory is False)
        ns = c.register_layout(LAYOUT)
        keys = [f"packed-{shared_memory}-{i}".encode().ljust(24, b".") for i in range(5)]
        packed = Packed(b"".join(keys), 24)
        data = np.random.default_rng(5).integers(0, 256, (5, ns.page_bytes), dtype=np.uint8)
        assert c.put(ns, packed, data).stored == 5
        assert c.put(ns, packed, data).skipped == 5
        out = page_aligned_empty((5, ns.page_bytes))
        c.get_into(ns, packed, out)
        assert np.array_equal(out, data)
        one = page_aligned_empty((1, ns.page_bytes))
        c.get_into(ns, Packed(keys[3], 24), one)               # as a list of one would
        assert np.array_equal(one[0], data[3])
        c.get_into(ns, Packed(b"", 24), page_aligned_empty((0, ns.page_bytes)))
