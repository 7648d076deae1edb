"""The disk tier inside a real server: spill, read-back, restarts, corruption, disk full."""

import contextlib
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest
import xxhash

from kvstore_client import KVStoreClient, PageLayout
from kvstore_testing.serverproc import ServerProcess
from tests.waiting import wait_for, wait_value

LAYOUT = PageLayout(model="disk", num_layers=32, page_tokens=16, num_kv_heads=8,
                    head_size=64)                                # 1 MiB pages
N = 150                                                          # 150 MiB of pages


def keys(n, tag="p"):
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def page(i):
    return np.random.default_rng(i).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)


def fill(client, ns, n=N):
    ks = keys(n)
    for start in range(0, n, 10):
        chunk = range(start, min(n, start + 10))
        client.put(ns, [ks[i] for i in chunk], np.stack([page(i) for i in chunk]))
    return ks


def served(client, ns, ks):
    """Indexes of pages the server returns, each checked byte-exact."""
    good = []
    for i, key in enumerate(ks):
        try:
            got = client.get(ns, [key])[0]
        except KeyError:
            continue
        assert np.array_equal(got, page(i)), f"page {i} came back different"
        good.append(i)
    return good


def disk_stats(client):
    tiers = {t.name: t for t in client.stats().tiers}
    return tiers["disk"]


def wait_written(client, pages, timeout=30):
    return wait_value(lambda: disk_stats(client).pages, lambda n: n >= pages,
                      f"{pages} pages on disk", timeout=timeout, interval=0.1)


def server(tmp_path, **flags):
    flags = {"dram": "32MiB", "disk": "512MiB", "disk_dir": str(tmp_path / "disk"), **flags}
    return ServerProcess(**flags)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "grpc"])
def test_pages_spill_and_come_back_byte_exact(tmp_path, shm):
    with server(tmp_path) as srv, KVStoreClient(srv.address, shared_memory=shm) as c:
        ns = c.register_layout(LAYOUT)
        ks = fill(c, ns)
        assert c.stats().tiers[0].pages < N                     # most left DRAM
        assert c.lookup(ns, ks) == N                            # ... but all are still here
        assert all(c.exists(ns, ks))
        assert served(c, ns, ks) == list(range(N))
        d = disk_stats(c)
        assert d.writes > 0 and d.reads > 0 and d.corrupt == 0 and not d.failed
        assert c.stats().tiers[0].used_bytes <= 32 << 20


def test_sigterm_restart_comes_back_warm(tmp_path):
    srv = server(tmp_path).start()
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(LAYOUT)
        ks = fill(c, ns)
    assert srv.stop(signal.SIGTERM) == 0
    assert "flushed DRAM to disk" in srv.log()
    with server(tmp_path, port=srv.port) as again, KVStoreClient(again.address) as c:
        ns = c.register_layout(LAYOUT)
        back = served(c, ns, ks)
        assert len(back) >= 0.95 * N, f"only {len(back)} of {N} pages after SIGTERM"
        assert c.lookup(ns, ks) == len(back) or c.lookup(ns, ks) >= 0.95 * N


def test_sigkill_keeps_every_page_that_reached_disk(tmp_path):
    srv = server(tmp_path).start()
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(LAYOUT)
        ks = fill(c, ns)
        on_disk = wait_written(c, N - 40)
    srv.stop(signal.SIGKILL)
    with server(tmp_path, port=srv.port) as again, KVStoreClient(again.address) as c:
        ns = c.register_layout(LAYOUT)
        assert disk_stats(c).pages >= on_disk
        assert len(served(c, ns, ks)) >= on_disk


def test_flipped_bytes_are_never_served(tmp_path):
    srv = server(tmp_path).start()
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(LAYOUT)
        ks = fill(c, ns)
    srv.stop(signal.SIGTERM)
    rng = np.random.default_rng(3)
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path / "disk") for f in fs
             if os.path.getsize(os.path.join(dp, f)) > 1 << 20]
    assert files
    for path in files:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            for pos in rng.integers(0, size, 200).tolist():
                f.seek(pos)
                byte = f.read(1)
                f.seek(pos)
                f.write(bytes([byte[0] ^ 0xFF]))
    with server(tmp_path, port=srv.port) as again, KVStoreClient(again.address) as c:
        ns = c.register_layout(LAYOUT)
        back = served(c, ns, ks)                    # asserts every served page is exact
        d = disk_stats(c)
        assert len(back) < N and d.corrupt > 0          # found at restart or on read
        assert again.proc.poll() is None


def test_disk_full_stops_the_tier_and_dram_goes_on(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "kvtest", str(small)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        # The tier fits at start (a disk larger than its folder's free space is refused
        # then); another file takes the space once it runs.
        with server(tmp_path, disk="40MiB", disk_dir=str(small)) as srv, \
                KVStoreClient(srv.address) as c:
            with open(small / "filler", "wb") as f:
                with contextlib.suppress(OSError):             # full: as intended
                    f.write(bytes(40 << 20))
            ns = c.register_layout(LAYOUT)
            ks = fill(c, ns, 80)
            assert wait_for(lambda: disk_stats(c).failed, "the disk tier to fail", timeout=20,
                            interval=0.1)
            fresh = keys(5, "after")
            c.put(ns, fresh, np.stack([page(i) for i in range(5)]))   # DRAM still takes pages
            assert np.array_equal(c.get(ns, fresh), np.stack([page(i) for i in range(5)]))
            served(c, ns, ks)                                          # whatever is left is exact
            assert srv.proc.poll() is None
            assert "disk" in srv.log().lower()
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_admin_evicts_the_disk_tier(tmp_path):
    with server(tmp_path) as srv, KVStoreClient(srv.address) as c:
        ns = c.register_layout(LAYOUT)
        ks = fill(c, ns, 60)
        wait_written(c, 20)
        resp = c.evict(everything=True, tier="all")
        assert resp.pages > 0
        assert c.lookup(ns, ks) == 0 and disk_stats(c).pages == 0


def test_stray_names_in_the_disk_folder_lose_nothing(tmp_path):
    """Only the names the tier makes are slot files: `069632.slots` beside the real file
    was read as the same size, the file was indexed twice, and every page's second
    sighting, taken for an older copy, was blanked. A symlink is never followed: pages
    were spilled into the file it named."""
    disk = tmp_path / "disk"
    srv = ServerProcess(dram="32MiB", disk="512MiB", disk_dir=str(disk)).start()
    with KVStoreClient(srv.address) as client:
        ns = client.register_layout(LAYOUT)
        ks = fill(client, ns, 60)
    assert srv.stop(signal.SIGTERM) == 0
    (slots,) = [p for p in disk.iterdir() if p.suffix == ".slots"]
    os.link(slots, disk / ("0" + slots.name))
    arabic_indic = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
    os.link(slots, disk / (slots.stem.translate(arabic_indic) + ".slots"))
    (disk / "0.slots").write_bytes(b"")
    with ServerProcess(dram="32MiB", disk="512MiB", disk_dir=str(disk)) as again, \
            KVStoreClient(again.address) as client:
        assert len(served(client, client.register_layout(LAYOUT), ks)) == 60
        assert disk_stats(client).corrupt == 0 and disk_stats(client).pages == 60
        assert f"ignoring 0{slots.name}" in again.log()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, disk / ".direct-probe")
    os.symlink(victim, disk / f"{int(slots.stem) * 4}.slots")
    refused = ServerProcess(dram="32MiB", disk="512MiB", disk_dir=str(disk))
    with pytest.raises(RuntimeError):
        refused.start(wait=30)
    assert "not symlinks" in refused.log()
    assert victim.read_bytes() == b"keep"


def test_a_disk_folder_removed_under_the_server_fails_the_tier(tmp_path):
    """Writes went on into unlinked files, a stop's flush said every page was written,
    and the restart found none, with no word anywhere."""
    disk = tmp_path / "disk"
    with ServerProcess(dram="32MiB", disk="512MiB", disk_dir=str(disk)) as srv, \
            KVStoreClient(srv.address) as client:
        ns = client.register_layout(LAYOUT)
        fill(client, ns, 60)
        shutil.rmtree(disk)
        more = keys(60, "after")
        for start in range(0, 60, 10):
            client.put(ns, more[start:start + 10], np.stack([page(i) for i in range(10)]))
        wait_for(lambda: disk_stats(client).failed, "the tier to notice its folder was gone",
                 timeout=20, interval=0.05)
        assert "the folder was removed while the server ran" in srv.log()
