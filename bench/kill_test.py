"""Kill test: SIGKILL the server again and again under puts, spills and deletes with the disk
tier, restart it on the same folder each time, and check what comes back.

Each round: start the server (on the same --disk-dir; every other round with a smaller
--disk, so the rebuild finds more than fits), check it, load it for a random 0.5-2.5 s,
SIGKILL it. The load is W writer threads, each owning its own keys so that it knows the
last acknowledged operation on each one:

    put      a run of 1..8 of its keys, pages made from the keys (load_test.page_of)
    delete   a run of its keys; acknowledged = "must never be seen again" until put again
    get      a run of its keys that Lookup finds; every byte compared with the key's page

and one spiller that moves every DRAM page to disk (Admin Evict --all) every 50-200 ms,
so deletes hit pages on disk, in the write queue and in DRAM. An operation in flight at
the kill is forgotten (its outcome is unknown).

After each restart, before the load: every key whose last acknowledged operation was a
delete must be absent (Exists), and every page found (Lookup, Get) must be its key's
bytes. The run fails if a restart fails, a page is wrong (corrupt), or a deleted key
comes back (resurrected). The rebuild's count of torn or corrupt slots (slots a kill cut
in the middle of a write: detected and skipped, never served) is printed, not failed on.

    kvstore-bench kill-test [--kills 30] [--writers 4] [--dram 16MiB] [--disk 6MiB]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import signal
import tempfile
import threading
import time

import numpy as np

from kvstore_client import KVStoreClient, PageLayout
from kvstore_protocol.units import parse_size
from kvstore_testing.serverproc import ServerProcess

from .load_test import key_of, page_of

__all__ = ["KillConfig", "KillResult", "main", "run"]

# 64 KiB pages: thousands fit the default tiers, and a spill batch is a few MiB.
LAYOUT = PageLayout(model="kill-test", num_layers=4, page_tokens=16, num_kv_heads=2,
                    head_size=128, dtype="float32")


@dataclasses.dataclass(frozen=True, slots=True)
class KillConfig:
    kills: int = 30
    writers: int = 4
    keys_per_writer: int = 600
    dram: int = 16 << 20
    disk: int = 6 << 20             # every other round starts with 3/4 of it
    seed: int = 0


@dataclasses.dataclass(slots=True)
class KillResult:
    kills: int = 0
    restarts_ok: int = 0
    restarts_failed: int = 0
    pages_checked: int = 0
    corrupt_served: int = 0         # a page served with bytes other than its key's
    deletes_acked: int = 0
    deletes_checked: int = 0        # acknowledged deletes checked after a restart
    resurrected: int = 0            # ... that came back
    torn_slots: int = 0             # rebuild: slots cut by a kill, skipped (not served)
    rebuilt_pages: int = 0
    ops: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.restarts_failed or self.corrupt_served or self.resurrected)


class _Writer:
    """One thread's keys and the last acknowledged operation on each."""

    def __init__(self, index: int, n: int, rng: random.Random) -> None:
        self.keys = [key_of(index * 1_000_000 + i) for i in range(n)]
        self.deleted: set[int] = set()      # last acknowledged op: delete
        self.rng = rng

    def round(self, client: KVStoreClient, ns, stop: threading.Event, result: KillResult,
              lock: threading.Lock) -> None:
        n = len(self.keys)
        while not stop.is_set():
            start = self.rng.randrange(n)
            idx = list(range(start, min(n, start + self.rng.randint(1, 8))))
            ks = [self.keys[i] for i in idx]
            op = self.rng.random()
            try:
                if op < 0.5:
                    pages = np.stack([page_of(k, ns.page_bytes) for k in ks])
                    # Unknown until acknowledged: not "deleted" from the moment it starts.
                    self.deleted.difference_update(idx)
                    client.put(ns, ks, pages)
                elif op < 0.75:
                    pending = set(idx)
                    client.delete(ns, ks)
                    self.deleted |= pending
                    with lock:
                        result.deletes_acked += len(pending)
                else:
                    bad, checked = _check_pages(client, ns, ks)
                    with lock:
                        result.corrupt_served += bad
                        result.pages_checked += checked
                    if bad:
                        result.errors.append(f"wrong bytes served for a key of {ks}")
                with lock:
                    result.ops += 1
            except Exception:  # noqa: BLE001 - the kill makes calls fail any which way
                # The op's outcome is unknown: a put's keys are already untracked, and a
                # failed delete leaves them as they were (deleted stays deleted).
                if stop.is_set():
                    return
                time.sleep(0.01)


def _check_pages(client: KVStoreClient, ns, ks) -> tuple[int, int]:
    """(pages with wrong bytes, pages checked) of the leading keys Lookup finds."""
    found = client.lookup(ns, ks)
    if not found:
        return 0, 0
    try:
        got = client.get(ns, ks[:found])
    except KeyError:
        return 0, 0                         # evicted between the lookup and the get
    bad = sum(not np.array_equal(got[i], page_of(k, ns.page_bytes))
              for i, k in enumerate(ks[:found]))
    return bad, found


def _verify(client: KVStoreClient, ns, writers: list[_Writer], result: KillResult) -> None:
    """After a restart: acknowledged deletes stay deleted, every page found is intact."""
    for w in writers:
        gone = sorted(w.deleted)
        for start in range(0, len(gone), 4096):
            ks = [w.keys[i] for i in gone[start:start + 4096]]
            present = client.exists(ns, ks)
            back = [k for k, p in zip(ks, present) if p]
            result.deletes_checked += len(ks)
            result.resurrected += len(back)
            if back:
                result.errors.append(f"{len(back)} deleted keys came back, e.g. {back[0].hex()}")
        for start in range(0, len(w.keys), 8):
            bad, checked = _check_pages(client, ns, w.keys[start:start + 8])
            result.corrupt_served += bad
            result.pages_checked += checked


def run(config: KillConfig, log=print) -> KillResult:
    rng = random.Random(config.seed)
    result = KillResult()
    folder = tempfile.mkdtemp(prefix="kvstore-kill-")
    writers = [_Writer(i, config.keys_per_writer, random.Random(rng.random()))
               for i in range(config.writers)]
    lock = threading.Lock()
    try:
        for round_ in range(config.kills + 1):
            disk = config.disk if round_ % 2 == 0 else config.disk * 3 // 4
            srv = ServerProcess(dram=str(config.dram), disk=str(disk), disk_dir=folder,
                                lease_ttl="5s")
            try:
                srv.start(wait=60)
            except RuntimeError as exc:
                result.restarts_failed += 1
                result.errors.append(f"round {round_}: restart failed: {str(exc)[-400:]}")
                log(f"round {round_}: RESTART FAILED")
                srv.stop(signal.SIGKILL)
                continue
            result.restarts_ok += round_ > 0
            client = KVStoreClient(srv.address, timeout=10, retries=0)
            try:
                ns = client.register_layout(LAYOUT)
                disk_stats = client.stats().tiers[1]
                result.torn_slots += disk_stats.corrupt
                result.rebuilt_pages += disk_stats.pages
                _verify(client, ns, writers, result)
                if round_ == config.kills:
                    break
                stop = threading.Event()
                threads = [threading.Thread(target=w.round, args=(client, ns, stop, result, lock))
                           for w in writers]
                threads.append(threading.Thread(target=_spill, args=(client, stop, rng.random())))
                for t in threads:
                    t.start()
                time.sleep(rng.uniform(0.5, 2.5))
                srv.send_signal(signal.SIGKILL)     # mid-load: no flush, no clean stop
                result.kills += 1
                stop.set()
                for t in threads:
                    t.join(60)
            finally:
                client.close()
                srv.stop(signal.SIGKILL)
            log(f"round {round_}: disk held {disk_stats.pages} pages, {disk_stats.corrupt} torn "
                f"slots skipped; {result.ops} ops, {result.deletes_checked} deletes checked, "
                f"{result.resurrected} resurrected, {result.corrupt_served} corrupt")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def _spill(client: KVStoreClient, stop: threading.Event, seed: float) -> None:
    rng = random.Random(seed)
    while not stop.wait(rng.uniform(0.05, 0.2)):
        try:
            client.evict(everything=True)
        except Exception:  # noqa: BLE001
            if stop.is_set():
                return


def report(result: KillResult) -> str:
    return (f"kill test: {result.kills} SIGKILLs, restarts {result.restarts_ok} ok / "
            f"{result.restarts_failed} failed; {result.ops} ops; {result.pages_checked} pages "
            f"checked, {result.corrupt_served} corrupt; {result.deletes_acked} deletes "
            f"acknowledged, {result.deletes_checked} checked after restarts, "
            f"{result.resurrected} resurrected; {result.torn_slots} torn slots skipped at "
            f"rebuild; {result.rebuilt_pages} pages rebuilt in all -> "
            f"{'PASS' if result.ok else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench kill-test", description=__doc__.split("\n")[0])
    d = KillConfig()
    p.add_argument("--kills", type=int, default=d.kills)
    p.add_argument("--writers", type=int, default=d.writers)
    p.add_argument("--keys-per-writer", type=int, default=d.keys_per_writer)
    p.add_argument("--dram", type=parse_size, default=d.dram)
    p.add_argument("--disk", type=parse_size, default=d.disk)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    result = run(KillConfig(a.kills, a.writers, a.keys_per_writer, a.dram, a.disk, a.seed))
    for line in result.errors[:20]:
        print("  " + line)
    print(report(result))
    return 0 if result.ok else 1
