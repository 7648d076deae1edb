"""Clients across a server restart: a client made after the restart is answered at once,
whatever an older client of the same process met while the server was down."""

import time

import pytest

from kvstore_client import KVStoreClient, KVStoreError
from kvstore_testing.serverproc import ServerProcess


def test_a_new_client_is_answered_at_once_after_a_restart():
    srv = ServerProcess(dram="32MiB").start()
    old = KVStoreClient(srv.address, timeout=2.0, retries=0)
    try:
        old.stats()
        srv.proc.kill()
        srv.stop()
        # The old client keeps asking while nothing listens: its connection's reconnect
        # backoff grows to its cap.
        down_until = time.monotonic() + 3.0
        while time.monotonic() < down_until:
            with pytest.raises(KVStoreError):
                old.stats()
            time.sleep(0.05)
        again = ServerProcess(port=srv.port, dram="32MiB").start()   # healthy on return
        try:
            # No retries: its first attempt must reach the new server, not wait out the
            # old client's backoff.
            with KVStoreClient(again.address, timeout=2.0, retries=0) as fresh:
                assert fresh.stats().leases == 0
        finally:
            again.stop()
    finally:
        old.close()
