"""connector.worker.hostmem against a real server restarted under it: every offset is used with
the mapping that issued it, an old mapping stays readable while a copy may still use it,
and its registration goes at the step boundary where nothing names it (CPU: registrations
are no-op objects, the bookkeeping is the same)."""

import signal

import numpy as np
import pytest

pytest.importorskip("torch")

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.worker.hostmem import Mappings

LAYOUT = PageLayout(model="hostmem", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=8, dtype="float32")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_restart_gives_a_new_mapping_and_the_old_one_goes_when_unused(fresh_server,
                                                                         tmp_path, how):
    srv = fresh_server(dram="16MiB", disk="16MiB", disk_dir=str(tmp_path / "disk"))
    mappings = Mappings()
    with KVStoreClient(srv.address, shared_memory=True, timeout=5.0) as client:
        ns = client.register_layout(LAYOUT)
        page = np.full(ns.page_bytes, 7, dtype=np.uint8)
        res = client.reserve(ns, [b"a" * 16])
        old_region = res.region
        old = mappings.mem(old_region)
        assert old is mappings.mem(old_region)         # registered once per mapping
        first = int(res.offsets[0])
        old[first:first + ns.page_bytes] = page
        res.commit()

        if how == signal.SIGKILL:
            srv.stop(how)
        else:
            assert srv.stop(how) == 0
        srv.start()
        # The client re-attaches on its first call to the new server, closing its old
        # region object; the bytes we registered stay mapped while we hold them.
        res = client.reserve(ns, [b"b" * 16])
        assert res.region is not old_region
        new = mappings.mem(res.region)
        new[res.offsets[0]:res.offsets[0] + ns.page_bytes] = page + 1
        res.commit()
        assert (old[first:first + ns.page_bytes] == 7).all()   # still mapped for a copy
        # A region the client dropped before we first used it cannot be used at all.
        with pytest.raises(OSError, match="restarted"):
            Mappings().mem(old_region)

        mappings.keep_only([old_region, res.region])    # a copy still names the old one
        assert len(mappings._by_region) == 2
        mappings.keep_only([res.region])                # a step later nothing does
        assert len(mappings._by_region) == 1
        assert mappings.mem(res.region) is new

        # What each server holds was written through its own mapping.
        got = client.get(ns, [b"b" * 16])[0]
        assert (got == 8).all()
        if how == signal.SIGTERM:                       # the disk tier kept the first page
            assert (client.get(ns, [b"a" * 16])[0] == 7).all()
        mappings.close()
        assert not mappings._by_region
