"""SGLang HiCache benchmark: batch_set_v1/batch_get_v1 of 128 pages against a plain copy.

A real kvstore-server on loopback and SGLang 0.5.23's own MHA host pool in each layout;
`KVStoreHiCacheStorage` moves 128 pages (2 MiB each by default) between the host pool and
the server's shared-memory pool. In the same run, a plain numpy copy of the same number
of bytes between two pre-touched buffers gives the ceiling; the ratios are against it.
Needs SGLang (.venv-sglang, scripts/venv-sglang.sh).

    .venv-sglang/bin/python -m kvstore_bench.sglang_bench [--quick] [--json]

Also the place the SGLang tests build host pools from (`host_pool`, `storage_config`,
`install_torchvision_stub`): one recipe for SGLang's pools, shared by bench and tests.
"""

from __future__ import annotations

import argparse
import enum
import json
import statistics
import sys
import time
import types

from kvstore_testing.serverproc import ServerProcess

from .shm_bench import memcpy_gbps

__all__ = ["host_pool", "install_torchvision_stub", "main", "make_backend", "run",
           "storage_config"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGES = 128    # SGLang's STORAGE_BATCH_SIZE: the most pages one storage call carries


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def install_torchvision_stub() -> None:
    """Let SGLang 0.5.23 import beside a CPU-only torch.

    The registry's torchvision does not import beside the CPU torch, and SGLang's
    host-pool modules reach it only through image-processing imports never run here.
    transformers is asked first, so it caches "no torchvision" and never uses the stub.
    Does nothing when a torchvision is already imported or importable.
    """
    if "torchvision" in sys.modules:
        return
    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # noqa: BLE001 - absent, or present but broken beside this torch
        sys.modules.pop("torchvision", None)
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                 "torchvision.io"):
        module = types.ModuleType(name)
        module.__path__ = []     # a package, so its submodules resolve
        module.InterpolationMode = _InterpolationMode
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def host_pool(kind: str, layout: str, *, layers: int = 2, heads: int = 2, head_dim: int = 16,
              page_size: int = 4, pages: int = 16, dtype=None):
    """SGLang's own MHA ("mha") or MLA ("mla") host pool on CPU, filled with zeros.

    Built from per-layer CPU "device" buffers and their pointer tables, as SGLang's
    device pools describe themselves (MHABufferInfo / MLABufferInfo). It holds at least
    `pages` pages of `page_size` tokens; for MLA, head_dim is the latent width.
    """
    install_torchvision_stub()
    import torch
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    cpu = torch.device("cpu")
    tokens = pages * page_size

    def per_layer(rows: int) -> tuple:
        return tuple(torch.zeros(tokens + page_size, rows, head_dim, dtype=dtype)
                     for _ in range(layers))

    def ptrs(tensors) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)

    common = {"host_to_device_ratio": 1.0, "host_size": 0, "page_size": page_size,
              "layout": layout, "pin_memory": False, "device": "cpu",
              "device_capacity_tokens": tokens, "start_layer": 0, "end_layer": layers}
    nbytes = 4 * layers * tokens * heads * head_dim * dtype.itemsize + (1 << 30)
    with host_memory_budget_scope(nbytes):    # skip SGLang's free-RAM check
        if kind == "mha":
            k, v = per_layer(heads), per_layer(heads)
            info = MHABufferInfo(
                buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                  layout=KVBufferLayout.NHD),
                page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                dtype=dtype, device=cpu)
            return MHATokenToKVPoolHost(info, **common)
        if kind != "mla":
            raise ValueError(f"kind must be 'mha' or 'mla', got {kind!r}")
        rope = min(8, head_dim // 2)
        rows = per_layer(1)
        info = MLABufferInfo(
            buffers=rows, data_ptrs=ptrs(rows), layer_indices=tuple(range(layers)),
            device_layer_num=layers, page_size=page_size, kv_lora_rank=head_dim - rope,
            qk_rope_head_dim=rope, kv_cache_dim=head_dim, dtype=dtype, device=cpu)
        return MLATokenToKVPoolHost(info, target_layer_num=layers, **common)


def storage_config(server: str, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   model: str = "test-model", **extra):
    """SGLang's HiCacheStorageConfig naming this backend through the "dynamic" factory."""
    install_torchvision_stub()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=False, model_name=model,
        extra_config={"backend_name": "kvstore", "module_path": "kvstore_connector.sglang",
                      "class_name": "KVStoreHiCacheStorage", "server": server,
                      "interface_v1": True, **extra})


def make_backend(config, pool):
    """The backend as SGLang builds it: the factory, then the pool registration."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def _gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def layout_gbps(server: ServerProcess, layout: str, reps: int, geometry: dict) -> dict:
    """Median GB/s of batch_set_v1 and batch_get_v1 of PAGES pages in one host layout."""
    import torch

    pool = host_pool("mha", layout, pages=2 * PAGES, **geometry)
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    backend = make_backend(storage_config(server.address, model=f"bench-{layout}"), pool)
    nbytes = PAGES * backend.handle.page_bytes
    src = torch.arange(PAGES * pool.page_size, dtype=torch.int64)
    dst = src + PAGES * pool.page_size
    sets, gets = [], []
    for rep in range(reps + 1):                   # rep 0 warms up
        keys = [f"{layout}-{rep}-{i}" for i in range(PAGES)]
        backend.client.evict(everything=True, tier="all")   # room, untimed
        t0 = time.perf_counter()
        ok = backend.batch_set_v1(keys, src)
        t1 = time.perf_counter()
        hits = backend.batch_get_v1(keys, dst)
        t2 = time.perf_counter()
        if not (all(ok) and all(hits)):
            raise RuntimeError(f"{layout}: set {sum(ok)}/{PAGES}, get {sum(hits)}/{PAGES}")
        if rep:
            sets.append(t1 - t0)
            gets.append(t2 - t1)
    backend.close()
    return {"page_bytes": backend.handle.page_bytes, "set_gbps": _gbps(nbytes, sets),
            "get_gbps": _gbps(nbytes, gets)}


def run(quick: bool) -> dict:
    install_torchvision_stub()
    reps = 3 if quick else 7
    geometry = {"layers": 32, "heads": 8, "head_dim": 128, "page_size": 16}   # 2 MiB bf16
    if quick:
        geometry["layers"] = 8
    results: dict = {"pages": PAGES, "layouts": {}}
    with ServerProcess(dram="2GiB") as server:
        for layout in LAYOUTS:
            results["layouts"][layout] = layout_gbps(server, layout, reps, geometry)
    nbytes = PAGES * next(iter(results["layouts"].values()))["page_bytes"]
    results["bytes"] = nbytes
    results["memcpy_gbps"] = memcpy_gbps(nbytes, reps)
    for r in results["layouts"].values():
        r["set_vs_memcpy"] = r["set_gbps"] / results["memcpy_gbps"]
        r["get_vs_memcpy"] = r["get_gbps"] / results["memcpy_gbps"]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-bench sglang", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--quick", action="store_true", help="8-layer pages, 3 repetitions")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    results = run(args.quick)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{results['pages']} pages of {results['layouts']['page_first']['page_bytes']} bytes "
          f"({results['bytes'] / 2**20:.0f} MiB) per call; plain numpy copy "
          f"{results['memcpy_gbps']:.2f} GB/s")
    for layout, r in results["layouts"].items():
        print(f"  {layout:18s} batch_set_v1 {r['set_gbps']:6.2f} GB/s ({r['set_vs_memcpy']:.2f}x)"
              f"   batch_get_v1 {r['get_gbps']:6.2f} GB/s ({r['get_vs_memcpy']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
