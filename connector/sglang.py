"""SGLang adapter: `KVStoreHiCacheStorage`, a HiCache storage backend for SGLang 0.5.23.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name":"kvstore","module_path":"kvstore_connector.sglang",
          "class_name":"KVStoreHiCacheStorage","server":"127.0.0.1:50051","interface_v1":true}'

Besides SGLang's own keys, the extra config takes the fields of
connector.config.ConnectorConfig; those that mean something to this backend are server,
timeout, probe_interval, salt, model, model_revision, shared_memory, token and the TLS
files (the others are the vLLM connector's).

How SGLang drives a backend (managers/cache_controller.py):

    StorageBackendFactory.create_backend("dynamic") -> cls(storage_config, {})
    register_mem_pool_host(host_pool), on_host_pools_registered()
    prefetch thread: batch_exists(keys) -> hits; batch_get_v1(keys[:hits], host_indices)
    backup thread:   batch_set_v1(keys, host_indices)        (interface_v1)
                     batch_set(keys, flat pages) / batch_get  (otherwise)

Keys and pages. SGLang names a page by a chained hash string; the store key is
xxh3_128 of that string, so any hash format fits the store's 16-byte keys. How a host
pool's pages map onto the store's, and the PageLayout that keeps pages of two ranks,
dtypes or models apart: connector.sglang_pages.

Failures. A backend error never raises into SGLang's prefetch or backup threads (SGLang
#38428 lost its prefetch thread that way): every store error becomes a miss or a failed
write, is logged, and is counted in `failures` (a Failures record).
"""

# The methods SGLang calls keep its HiCacheStorage signatures verbatim, List and Optional
# included (tests compare them with inspect.signature), hence:
# ruff: noqa: UP006, UP035, UP045

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, List, Optional

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstore_client import KVStoreClient, KVStoreError, LayoutHandle, PagesMissing

from .breaker import Breaker, not_answering
from .config import ConnectorConfig, open_client
from .revision import resolve
from .sglang_pages import PageCodec, layout_of

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

__all__ = ["Failures", "KVStoreHiCacheStorage", "PageCodec", "store_key"]

log = logging.getLogger(__name__)


class _Op(enum.Enum):
    """What SGLang asked of the backend, as its logs and counts name it."""

    GET = "get"          # a prefetch: pages into the host pool
    SET = "set"          # a backup: pages out of it
    EXISTS = "exists"    # a lookup (and clear)


@dataclasses.dataclass(slots=True)
class Failures:
    """What failed since the backend started: a miss or a failed write for SGLang."""

    get: int = 0         # pages not loaded
    set: int = 0         # pages not stored
    exists: int = 0      # calls (batch_exists, clear)

    def add(self, op: _Op, count: int) -> None:
        if op is _Op.GET:
            self.get += count
        elif op is _Op.SET:
            self.set += count
        else:
            self.exists += count


def store_key(key: str) -> bytes:
    """The 16-byte store key of an SGLang page hash (any string format)."""
    return xxhash.xxh3_128_digest(key.encode())


def _revision(config: HiCacheStorageConfig, pool, settings: ConnectorConfig) -> str:
    """The weights' revision (connector.revision): `model_revision` in the storage
    backend's extra config, else a fingerprint of the model path's folder. SGLang hands
    a backend its model path (tagged with the host pool's page format, if it has one),
    not its --revision."""
    model = config.model_name or ""
    tag = getattr(pool, "storage_format_tag", None)
    if tag and model.endswith(f"-{tag}"):
        model = model[:-len(tag) - 1]
    return resolve(settings.model_revision, None, model, "SGLang").value


@dataclasses.dataclass(slots=True)
class _Metrics:
    """SGLang's storage metrics since the last get_stats (StorageMetrics' fields)."""

    prefetch_pgs: list[int] = dataclasses.field(default_factory=list)
    backup_pgs: list[int] = dataclasses.field(default_factory=list)
    prefetch_bandwidth: list[float] = dataclasses.field(default_factory=list)   # GB/s a call
    backup_bandwidth: list[float] = dataclasses.field(default_factory=list)

    def add(self, op: _Op, pages: int, gbps: float) -> None:
        """One prefetch (GET) or backup (SET) call's pages and rate."""
        if op is _Op.GET:
            self.prefetch_pgs.append(pages)
            self.prefetch_bandwidth.append(gbps)
        else:
            self.backup_pgs.append(pages)
            self.backup_bandwidth.append(gbps)


class KVStoreHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage in a kvstore-server; thread-safe (prefetch and backup threads).

    Zero-copy on the server's host: pages move between the server's shared-memory pool
    and SGLang's host pool with one copy each; elsewhere they go over gRPC.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None,
                 *, client: Optional[KVStoreClient] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.settings = ConnectorConfig.from_mapping(ConnectorConfig.fields_of(extra))
        self.storage_config = storage_config
        self.client = client or open_client(self.settings, self.settings.timeout,
                                            shared_memory=self.settings.shared_memory)
        self.handle: Optional[LayoutHandle] = None   # set by register_mem_pool_host
        self.codec: Optional[PageCodec] = None
        self.failures = Failures()
        self._lock = threading.Lock()   # guards failures, _metrics, _region_view
        self._metrics = _Metrics()
        self._region_view: tuple[Any, torch.Tensor] | None = None   # (region, its tensor)
        # A store that does not answer would hold every prefetch and backup for the
        # whole timeout: after one such call, calls fail at once (misses) until the
        # breaker's probe, every probe_interval seconds on its own thread (never on
        # SGLang's), finds it answering (connector.breaker).
        self._breaker = Breaker(self.settings.probe_interval, self._probe)

    @property
    def breaker(self) -> Breaker:
        """The store's breaker: open while it is not answering, until a probe finds it is."""
        return self._breaker

    # -- setup ----------------------------------------------------------------------
    @property
    def _ns(self) -> LayoutHandle:
        """The registered layout; RuntimeError before register_mem_pool_host."""
        if self.handle is None:
            raise RuntimeError("register_mem_pool_host has not been called")
        return self.handle

    @property
    def _codec(self) -> PageCodec:
        if self.codec is None:
            raise RuntimeError("register_mem_pool_host has not been called")
        return self.codec

    def register_mem_pool_host(self, mem_pool_host: HostKVCache):
        super().register_mem_pool_host(mem_pool_host)
        layout = layout_of(self.storage_config, mem_pool_host, self.settings,
                           _revision(self.storage_config, mem_pool_host, self.settings))
        self.codec = PageCodec.of(mem_pool_host)
        try:
            self.handle = self.client.register_layout(layout)
        except KVStoreError as exc:
            # Not fatal: a server that is down now is retried by the first call.
            log.warning("kvstore: registering the layout failed (%s); retrying on use", exc)
            self.handle = LayoutHandle(layout, layout.layout_id, layout.page_bytes,
                                       layout.layer_bytes)

    def register_mem_host_pool_v2(self, host_pool: HostKVCache, host_pool_name):
        # SGLang's hybrid cache controller registers a hybrid model's side pools here
        # (Mamba / linear-attention state, sliding-window KV, ...) and then moves them
        # with the anchor's pages through batch_*_v2, which this backend does not store:
        # refused, so that SGLang's storage attach fails at start-up instead of a
        # hybrid model's pages being stored without their state.
        name = getattr(host_pool_name, "value", host_pool_name)
        raise ValueError(f"kvstore: SGLang host pool {name!r} ({type(host_pool).__name__}) "
                         f"of a hybrid model is not supported: only full-attention (MHA) "
                         f"and MLA models are stored")

    def _store_page(self, region, offset: int) -> torch.Tensor:
        """The page at a byte offset of `region`, the pool mapping whose server issued the
        offset (a reservation's or acquisition's own: after a restart, another mapping
        holds other pages there), as (L, kv, T, row)."""
        with self._lock:
            if self._region_view is None or self._region_view[0] is not region:
                self._region_view = (region, torch.from_numpy(region.mem))
            mem = self._region_view[1]
        lay = self._ns.layout
        return mem[offset:offset + self._ns.page_bytes].view(
            lay.num_layers, lay.kv_factor, lay.page_tokens, -1)

    def _probe(self) -> bool:
        """The breaker's probe (on its own thread): does the store answer?"""
        if self.handle is None:
            return True
        try:
            self.client.register_layout(self._ns.layout)
        except KVStoreError as exc:
            return not not_answering(exc)
        return True

    # -- moving pages -----------------------------------------------------------------
    def _write(self, keys: Sequence[str], sources: Callable[[int], torch.Tensor]) -> int:
        """Store pages; sources(i) is page i in store order. Returns pages newly stored."""
        skeys = [store_key(k) for k in keys]
        if self.client.region() is None:
            pages = torch.stack([sources(i).contiguous() for i in range(len(keys))])
            return self.client.put(self._ns, skeys, pages.numpy()).stored
        with self.client.reserve(self._ns, skeys) as res:
            for i, offset in enumerate(res.offsets.tolist()):
                if offset >= 0:
                    self._store_page(res.region, offset).copy_(sources(i))
            return res.commit()

    def _read(self, keys: Sequence[str], dests: Callable[[int], torch.Tensor]) -> List[bool]:
        """Load the pages that are stored into dests(i) (store order); which ones were."""
        skeys = [store_key(k) for k in keys]
        present = [True] * len(keys)
        try:
            self._read_all(skeys, list(range(len(keys))), dests)
        except PagesMissing:
            # Some pages are gone (evicted since batch_exists): load those still here.
            present = self.client.exists(self._ns, skeys)
            idx = [i for i, hit in enumerate(present) if hit]
            try:
                self._read_all([skeys[i] for i in idx], idx, dests)
            except PagesMissing:
                return [False] * len(keys)
        return present

    def _read_all(self, skeys: list, idx: list, dests: Callable[[int], torch.Tensor]) -> None:
        if not skeys:
            return
        if self.client.region() is None:
            pages = self.client.get(self._ns, skeys)   # PagesMissing when one is missing
            lay = self._ns.layout
            shape = (lay.num_layers, lay.kv_factor, lay.page_tokens, -1)
            for i, page in zip(idx, torch.from_numpy(pages), strict=True):
                dests(i).copy_(page.view(shape))
            return
        try:
            acq = self.client.acquire(self._ns, skeys)
        except KVStoreError as exc:
            raise PagesMissing.of(exc) from None     # a page gone: PagesMissing
        with acq:
            for i, offset in zip(idx, acq.offsets.tolist(), strict=True):
                dests(i).copy_(self._store_page(acq.region, offset))

    def _guard(self, what: _Op, pages: int, fallback, fn: Callable[[], Any]):
        """fn(), or fallback when the store (or anything below it) fails."""
        if self.handle is None:
            log.warning("kvstore: %s before register_mem_pool_host; treated as a miss",
                        what.value)
            self._count(what, pages)
            return fallback
        if not self._breaker.allow():
            self._count(what, pages)
            return fallback               # the store is not answering: a miss, at once
        began = time.monotonic()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - never into SGLang's threads (#38428)
            log.warning("kvstore: %s of %d page(s) failed: %s", what.value, pages, exc)
            if not_answering(exc):
                self._breaker.failed()
            self._count(what, pages)
            return fallback
        self._breaker.succeeded(began)    # SGLang calls from several threads
        return result

    def _count(self, what: _Op, pages: int) -> None:
        with self._lock:
            self.failures.add(what, pages)

    def _record(self, what: _Op, pages: int, start: float) -> None:
        gbps = pages * self._ns.page_bytes / max(time.perf_counter() - start, 1e-9) / 1e9
        with self._lock:
            self._metrics.add(what, pages, gbps)

    def _host_pages(self, host_indices: torch.Tensor, n: int) -> list[torch.Tensor]:
        if host_indices.numel() != n * self._codec.page_tokens:
            raise ValueError(f"{host_indices.numel()} host indices for {n} pages of "
                             f"{self._codec.page_tokens} tokens")
        starts = host_indices.reshape(-1)[::self._codec.page_tokens].tolist()
        return [self._codec.store_order(self._codec.host_page(s)) for s in starts]

    # -- zero-copy interface (interface_v1) --------------------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        def run():
            start = time.perf_counter()
            views = self._host_pages(host_indices, len(keys))
            hits = self._read(keys, views.__getitem__)
            self._record(_Op.GET, sum(hits), start)
            return hits
        return self._guard(_Op.GET, len(keys), [False] * len(keys), run)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        def run():
            start = time.perf_counter()
            views = self._host_pages(host_indices, len(keys))
            self._write(keys, views.__getitem__)
            self._record(_Op.SET, len(keys), start)
            return [True] * len(keys)
        return self._guard(_Op.SET, len(keys), [False] * len(keys), run)

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading pages stored, in one Lookup."""
        if not keys:
            return 0
        return self._guard(_Op.EXISTS, 1, 0, lambda: self.client.lookup(
            self._ns, [store_key(k) for k in keys]))

    # -- generic interface (flat data pages) ---------------------------------------------
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location])
        return None if isinstance(got, int) else got[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None] | int:
        def run():
            given = list(target_locations) if target_locations is not None else [None] * len(keys)
            outs = [o if o is not None else self.mem_pool_host.get_dummy_flat_data_page()
                    for o in given]
            start = time.perf_counter()
            hits = self._read(keys, lambda i: self._codec.flat(outs[i]))
            self._record(_Op.GET, sum(hits), start)
            return [o if hit else None for o, hit in zip(outs, hits, strict=True)]
        return self._guard(_Op.GET, len(keys), [None] * len(keys), run)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        def run():
            if values is None or len(values) != len(keys):
                raise ValueError("batch_set needs one flat page per key")
            start = time.perf_counter()
            self._write(keys, lambda i: self._codec.flat(values[i]))
            self._record(_Op.SET, len(keys), start)
            return True
        return self._guard(_Op.SET, len(keys), False, run)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- housekeeping -------------------------------------------------------------------
    def clear(self) -> None:
        """Drop this layout's pages (other layouts and engines keep theirs)."""
        if self.handle is not None:
            self._guard(_Op.EXISTS, 1, None, lambda: self.client.evict(
                layout_id=self._ns.layout_id, tier="all"))

    def get_stats(self):
        """SGLang's storage metrics since the last call (what its collector logs)."""
        with self._lock:
            m, self._metrics = self._metrics, _Metrics()
        return StorageMetrics(prefetch_pgs=m.prefetch_pgs, backup_pgs=m.backup_pgs,
                              prefetch_bandwidth=m.prefetch_bandwidth,
                              backup_bandwidth=m.backup_bandwidth)

    def close(self) -> None:
        self._breaker.close()
        self.client.close()
