"""connector.transfer on the GPU: byte-exact loads and saves in every cache kind (bf16),
per-layer events, and ordering against the compute stream. Run on the GPU machine."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.kvviews import KVKind, kv5
from kvstore_connector.transfer import CopyMethod, HostRegistration, KVTransfer

# The cases and their hand-written reference indexing live with the CPU tests; load that
# module by path (tests/unit is not a package) so both run the very same checks.
_spec = importlib.util.spec_from_file_location(
    "transfer_cases", pathlib.Path(__file__).resolve().parents[1] / "unit" / "test_transfer_cpu.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind_or_name,k", cases.CASES)
def test_load_bf16(server, kind_or_name, k):
    cases.run_load(server.address, kind_or_name, k, device="cuda", n_pages=6)


@pytest.mark.parametrize("kind_or_name,k", cases.CASES)
def test_save_bf16(server, kind_or_name, k):
    cases.run_save(server.address, kind_or_name, k, device="cuda", n_pages=6)


def test_copies_method_matches_on_cuda(server):
    caches = [cases.make_cache(KVKind.VLLM_4D, 4, device="cuda") for _ in range(2)]
    views = [kv5(t, KVKind.VLLM_4D) for t in caches]
    xfer = KVTransfer(views, 8, "cuda", method=CopyMethod.COPIES)
    layout = cases.layout_for(KVKind.VLLM_4D, 8, layers=2)
    pages = np.random.default_rng(5).integers(0, 256, (3, layout.page_bytes), dtype=np.uint8)
    host = torch.empty(pages.size, dtype=torch.uint8, pin_memory=True).numpy()
    host[:] = pages.reshape(-1)
    block_ids = np.array([[7, 2], [0, 11], [5, 6]])
    offsets = np.arange(3) * layout.page_bytes
    xfer.load(host, offsets, layout.layer_bytes, block_ids).synchronize()
    cases.check_loaded(caches, KVKind.VLLM_4D, layout, pages, block_ids)
    out = torch.zeros(pages.size, dtype=torch.uint8, pin_memory=True).numpy()
    for layer in range(2):
        xfer.save_layer(layer, out, offsets, block_ids)
    xfer.finish_save()
    assert np.array_equal(out, host)


LAYOUT_8B = PageLayout(model="gpu-overlap", num_layers=32, page_tokens=16, num_kv_heads=8,
                       head_size=128)   # 2 MiB pages, 64 KiB per layer


def _big_setup(client, n_pages, tag):
    ns = client.register_layout(LAYOUT_8B)
    ks = cases.keys(tag, n_pages)
    rng = np.random.default_rng(7)
    block = rng.integers(0, 256, LAYOUT_8B.page_bytes + 1040 * n_pages, dtype=np.uint8)
    with client.reserve(ns, ks) as res:
        for i, view in enumerate(res.views):
            view[:] = block[1040 * i:1040 * i + LAYOUT_8B.page_bytes]
    caches = [torch.zeros(2 * n_pages, 8, 16, 256, dtype=torch.bfloat16, device="cuda")
              for _ in range(LAYOUT_8B.num_layers)]
    return ns, ks, caches


def test_layer_zero_is_usable_while_later_layers_still_copy(fresh_server):
    """wait_layer(0) gates a consumer on layer 0 only: after that consumer has finished
    (the compute stream is idle), the load's last layer is still in flight."""
    srv = fresh_server(dram="2GiB")
    n_pages = 512                                        # 1 GiB: ~20 ms over PCIe
    with KVStoreClient(srv.address, shared_memory=True) as c:
        ns, ks, caches = _big_setup(c, n_pages, "overlap")
        mem = c.region().mem
        with HostRegistration(mem), c.acquire(ns, ks) as acq:
            xfer = KVTransfer([kv5(t, KVKind.VLLM_4D) for t in caches], 16, "cuda")
            block_ids = np.random.default_rng(1).permutation(2 * n_pages)[:n_pages]
            block_ids = block_ids.reshape(n_pages, 1).astype(np.int64)
            expect0 = np.stack([mem[o:o + ns.layer_bytes] for o in acq.offsets])
            for _ in range(2):                           # the first run compiles the kernel
                for t in caches:
                    t.zero_()
                torch.cuda.synchronize()
                handle = xfer.load(mem, acq.offsets, ns.layer_bytes, block_ids)
                handle.wait_layer(0)
                idx = torch.from_numpy(block_ids[:, 0]).cuda()
                consumed = kv5(caches[0], KVKind.VLLM_4D)[:, idx].transpose(0, 1).contiguous()
                torch.cuda.current_stream().synchronize()
                last_in_flight = not handle.done()
                handle.synchronize()
            assert last_in_flight, "the whole load had landed when layer 0's consumer ended"
            got = consumed.view(torch.uint8).reshape(n_pages, -1).cpu().numpy()
            assert np.array_equal(got, expect0)
            for layer in (1, 31):
                ref = np.stack([mem[o + layer * ns.layer_bytes:o + (layer + 1) * ns.layer_bytes]
                                for o in acq.offsets])
                back = kv5(caches[layer], KVKind.VLLM_4D)[:, idx].transpose(0, 1).contiguous()
                assert np.array_equal(back.view(torch.uint8).reshape(n_pages, -1).cpu().numpy(),
                                      ref)


def test_save_waits_for_the_compute_stream(server):
    """A layer's KV written on the compute stream just before save_layer is what is saved,
    even when the compute stream is still busy at the call."""
    kind, block_size = KVKind.FLASH_NHD, 4
    layout = cases.layout_for(kind, block_size, layers=1)
    cache = cases.make_cache(kind, block_size, device="cuda")
    xfer = KVTransfer([kv5(cache, kind)], block_size, "cuda")
    host = torch.zeros(4 * layout.page_bytes, dtype=torch.uint8, pin_memory=True).numpy()
    block_ids = np.array([[3], [9], [4], [20]])
    offsets = np.arange(4) * layout.page_bytes
    fresh = torch.randint(-2**15, 2**15, cache.shape, dtype=torch.int16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                       # ~0.1 s of GPU time on this stream
    cache.view(torch.int16).copy_(fresh)
    xfer.save_layer(0, host, offsets, block_ids)
    xfer.finish_save()
    want = [cases.expected_page([cache], kind, layout, b) for b in block_ids]
    assert np.array_equal(host.reshape(4, -1), np.stack(want))


def test_load_waits_for_the_compute_stream(server):
    """Blocks still being written on the compute stream are overwritten only after."""
    kind, block_size = KVKind.FLASH_NHD, 4
    layout = cases.layout_for(kind, block_size, layers=1)
    cache = cases.make_cache(kind, block_size, device="cuda")
    xfer = KVTransfer([kv5(cache, kind)], block_size, "cuda")
    pages = np.random.default_rng(2).integers(0, 256, (2, layout.page_bytes), dtype=np.uint8)
    host = torch.empty(pages.size, dtype=torch.uint8, pin_memory=True).numpy()
    host[:] = pages.reshape(-1)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    cache.view(torch.int16).fill_(cases.POISON)          # queued behind the sleep
    xfer.load(host, np.arange(2) * layout.page_bytes, layout.layer_bytes,
              np.array([[1], [8]])).synchronize()
    cases.check_loaded([cache], kind, layout, pages, np.array([[1], [8]]))


def test_registering_twice_is_harmless():
    mem = np.ones(1 << 20, dtype=np.uint8)
    with HostRegistration(mem) as first:
        second = HostRegistration(mem)
        assert first.registered and not second.registered
        second.close()
        cache = cases.make_cache(KVKind.FLASH_NHD, 4, device="cuda")
        xfer = KVTransfer([kv5(cache, KVKind.FLASH_NHD)], 4, "cuda")
        layout = cases.layout_for(KVKind.FLASH_NHD, 4, layers=1)
        xfer.load(mem, np.array([0]), layout.layer_bytes, np.array([[2]])).synchronize()
        assert bool((cache[:, 2].view(torch.uint8) == 1).all())
        torch.ones(4, device="cuda").sum().item()                # no stale CUDA error


def test_unregistered_host_memory_is_refused():
    """Pageable memory the GPU cannot address is refused with a clear error (on a system
    whose GPU can read pageable memory itself, the load must simply be right)."""
    cache = cases.make_cache(KVKind.FLASH_NHD, 4, device="cuda")
    xfer = KVTransfer([kv5(cache, KVKind.FLASH_NHD)], 4, "cuda")
    layout = cases.layout_for(KVKind.FLASH_NHD, 4, layers=1)
    host = np.full(layout.page_bytes, 3, dtype=np.uint8)          # pageable, not registered
    try:
        xfer.load(host, np.array([0]), layout.layer_bytes, np.array([[0]])).synchronize()
    except ValueError as exc:
        assert "HostRegistration" in str(exc)
    else:
        assert bool((cache[:, 0].view(torch.uint8) == 3).all())


# -- loads by the copy engine (CopyMethod.DMA) ---------------------------------------------------
# staging_bytes=1 leaves one page per staging buffer: every layer goes through both buffers
# several times, so a copy overwriting a buffer its scatter still reads would show.
@pytest.mark.parametrize("kind_or_name,k", cases.CASES)
def test_load_by_dma_one_run(server, kind_or_name, k):
    cases.run_load(server.address, kind_or_name, k, device="cuda", n_pages=12,
                   method=CopyMethod.DMA, staging_bytes=1, loads=2)


@pytest.mark.parametrize("kind_or_name,k", [(KVKind.VLLM_4D, 1), ("VLLM_4D_HNC", 2)])
def test_load_by_dma_runs_out_of_order(server, kind_or_name, k):
    order = np.array([3, 4, 5, 0, 1, 2, 9, 10, 11, 6, 8, 7])     # runs of 3, 3, 3, 2, 1, 1
    cases.run_load(server.address, kind_or_name, k, device="cuda", n_pages=12,
                   method=CopyMethod.DMA, staging_bytes=5 << 10, order=order, loads=3)



# -- saves by the copy engine: the kernel gathers into a staging buffer, 2D copies out ----------
# staging_bytes=1 leaves one page per buffer (both buffers alternate); 9 layers make groups
# 0-3, 4-7 and 8, so a group that does not start at layer 0 is covered.
@pytest.mark.parametrize("kind_or_name,k", cases.CASES)
def test_save_by_dma_one_run(server, kind_or_name, k):
    cases.run_save(server.address, kind_or_name, k, device="cuda", n_pages=12, layers=9,
                   method=CopyMethod.DMA, staging_bytes=1)


@pytest.mark.parametrize("kind_or_name,k", [(KVKind.VLLM_4D, 1), ("VLLM_4D_HNC", 2)])
def test_save_by_dma_runs_out_of_order(server, kind_or_name, k):
    order = np.array([3, 4, 5, 0, 1, 2, 9, 10, 11, 6, 8, 7])     # runs of 3, 3, 3, 2, 1, 1
    cases.run_save(server.address, kind_or_name, k, device="cuda", n_pages=12, layers=9,
                   method=CopyMethod.DMA, staging_bytes=5 << 10, order=order)


@pytest.mark.parametrize("kind_or_name,k", [(KVKind.VLLM_4D, 1), (KVKind.FLASH_NHD, 2)])
def test_save_by_the_kernel_when_named(server, kind_or_name, k):
    cases.run_save(server.address, kind_or_name, k, device="cuda", n_pages=12, layers=9,
                   method=CopyMethod.KERNEL)


def test_an_async_save_is_polled_and_the_fence_keeps_its_blocks(server):
    """finish_save(wait=False) returns at once with the copies still running (the save
    stream is held up behind a sleep); fence_saves makes later writes to the saved blocks
    on the compute stream wait for them, so the pool gets the KV of the save's time."""
    kind, block_size = KVKind.FLASH_NHD, 4
    layout = cases.layout_for(kind, block_size, layers=1)
    cache = cases.make_cache(kind, block_size, device="cuda")
    xfer = KVTransfer([kv5(cache, kind)], block_size, "cuda")
    host = torch.zeros(4 * layout.page_bytes, dtype=torch.uint8, pin_memory=True).numpy()
    block_ids = np.array([[3], [9], [4], [20]])
    offsets = np.arange(4) * layout.page_bytes
    torch.cuda.synchronize()
    want = [cases.expected_page([cache], kind, layout, b) for b in block_ids]
    with torch.cuda.stream(xfer._save_stream):
        torch.cuda._sleep(200_000_000)                   # the save stream is busy ~0.1 s
    xfer.save_layer(0, host, offsets, block_ids)
    handle = xfer.finish_save(wait=False)
    assert not handle.done()                             # returned with copies in flight
    xfer.fence_saves()
    cache.view(torch.int16).fill_(cases.POISON)          # the next step reuses the blocks
    handle.synchronize()
    assert handle.done()
    assert np.array_equal(host.reshape(4, -1), np.stack(want))


@pytest.mark.parametrize("n_pages,launches,save_launches,dma_pieces",
                         [(4, 1, 1, 1), (64, 16, 2, 16)])
def test_short_loads_and_saves_take_fewer_launches_and_stay_exact(fresh_server, monkeypatch,
                                                                   n_pages, launches,
                                                                   save_launches, dma_pieces):
    """A load or save of few pages covers more layers per kernel launch (4 pages of 64 KiB
    a layer: every layer in one; 64 pages saved by the kernel: sixteen layers a launch);
    loads and saves of 64 pages (4 MiB a layer) go by DMA in pieces of about 8 MiB (two
    layers a piece, one scatter or gather each), of 4 pages by the kernel; byte-exact
    every way, and every layer's wait gates on its launch's event."""
    from kvstore_connector.transfer import core
    counted = []
    real = core.kernel.launch

    def spy(geo, table, layer0, layers, *rest):
        counted.append(layers)
        return real(geo, table, layer0, layers, *rest)

    srv = fresh_server(dram="1GiB")
    with KVStoreClient(srv.address, shared_memory=True) as c:
        ns, ks, caches = _big_setup(c, n_pages, f"groups{n_pages}")
        mem = c.region().mem
        with HostRegistration(mem), c.acquire(ns, ks) as acq:
            xfer = KVTransfer([kv5(t, KVKind.VLLM_4D) for t in caches], 16, "cuda")
            block_ids = np.random.default_rng(3).permutation(2 * n_pages)[:n_pages]
            block_ids = block_ids.reshape(n_pages, 1).astype(np.int64)
            monkeypatch.setattr(core.kernel, "launch", spy)
            handle = xfer.load(mem, acq.offsets, ns.layer_bytes, block_ids)
            assert len(counted) == launches and sum(counted) == LAYOUT_8B.num_layers
            for layer in range(LAYOUT_8B.num_layers):
                handle.wait_layer(layer)
            pages = np.stack([mem[o:o + ns.page_bytes] for o in acq.offsets])
            stamped = torch.stack([t.view(torch.int16).sum() for t in caches])  # after the waits
            handle.synchronize()
            torch.cuda.synchronize()
            idx = torch.from_numpy(block_ids[:, 0]).cuda()
            for layer in range(LAYOUT_8B.num_layers):
                got = kv5(caches[layer], KVKind.VLLM_4D)[:, idx].transpose(0, 1).contiguous()
                lo, hi = layer * ns.layer_bytes, (layer + 1) * ns.layer_bytes
                assert np.array_equal(got.view(torch.uint8).reshape(n_pages, -1).cpu().numpy(),
                                      pages[:, lo:hi])
            assert torch.equal(stamped, torch.stack([t.view(torch.int16).sum() for t in caches]))
            offsets = np.arange(n_pages) * ns.page_bytes
            by_kernel = KVTransfer([kv5(t, KVKind.VLLM_4D) for t in caches], 16, "cuda",
                                   method=CopyMethod.KERNEL)
            for x, want in ((by_kernel, save_launches), (xfer, dma_pieces)):
                counted.clear()
                out = torch.zeros(pages.size, dtype=torch.uint8, pin_memory=True).numpy()
                for layer in range(LAYOUT_8B.num_layers):
                    x.save_layer(layer, out, offsets, block_ids)
                x.finish_save()
                assert len(counted) == want
                assert np.array_equal(out.reshape(n_pages, -1), pages)


def test_behind_looks_depth_calls_back():
    """behind(depth) answers whether the device is short of the stream's position `depth`
    calls ago: False until that many calls are marked, True while the GPU is still busy
    with work queued before that mark, False once it has caught up."""
    kind, block_size = KVKind.FLASH_NHD, 4
    xfer = KVTransfer([kv5(cases.make_cache(kind, block_size, device="cuda"), kind)],
                      block_size, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                       # ~0.1 s of GPU time
    assert [xfer.behind(2) for _ in range(4)] == [False, False, True, True]
    torch.cuda.synchronize()
    assert xfer.behind(2) is False                       # the mark 2 calls back was reached
    xfer.forget_mark()
    torch.cuda._sleep(200_000_000)
    assert [xfer.behind(1) for _ in range(3)] == [False, True, True]
    torch.cuda.synchronize()
    with pytest.raises(ValueError):
        xfer.behind(0)
