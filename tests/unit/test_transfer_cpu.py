"""connector.kvviews and connector.transfer on CPU tensors, against a real server's pool.

Every engine layout is checked against its own indexing written out by hand
(`engine_block`), not through kv5, so a wrong view cannot agree with itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

torch = pytest.importorskip(
    "torch", reason="the connector's transfer moves pages with torch (not installed)")

from kvstore_client import KVStoreClient, PageLayout  # noqa: E402
from kvstore_connector.kvviews import KVKind, detect_kind, kv5  # noqa: E402
from kvstore_connector.transfer import HostRegistration, KVTransfer  # noqa: E402

BLOCKS = 24
HEADS, HEAD, MLA_HEAD = 2, 8, 24
POISON = -12345                      # int16 pattern of every cache element not written


def keys(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def make_cache(kind: KVKind, block_size: int, dtype=torch.bfloat16, device="cpu",
               physical: str = "NHC") -> torch.Tensor:
    """An engine tensor of `kind`, filled with POISON. VLLM_4D is a strided view of a
    buffer in LBNHC ("NHC") or LBHNC ("HNC") order with a padded block stride."""
    n, h, d = block_size, HEADS, HEAD
    if kind is KVKind.FLASH_NHD:
        t = torch.empty(2, BLOCKS, n, h, d, dtype=dtype, device=device)
    elif kind is KVKind.FLASH_HND:
        t = torch.empty(2, BLOCKS, h, n, d, dtype=dtype, device=device)
    elif kind is KVKind.VLLM_4D:
        pad = 16                     # elements of padding after each block
        raw = torch.empty(BLOCKS, n * h * 2 * d + pad, dtype=dtype, device=device)
        if physical == "NHC":
            t = raw[:, :n * h * 2 * d].view(BLOCKS, n, h, 2 * d).permute(0, 2, 1, 3)
        else:
            t = raw[:, :n * h * 2 * d].view(BLOCKS, h, n, 2 * d)
        raw.view(torch.int16).fill_(POISON)
        return t
    elif kind is KVKind.MLA_3D:
        t = torch.empty(BLOCKS, n, MLA_HEAD, dtype=dtype, device=device)
    else:
        t = torch.empty(BLOCKS, 1, n, MLA_HEAD, dtype=dtype, device=device)
    t.view(torch.int16).fill_(POISON)
    return t


def engine_block(t: torch.Tensor, kind: KVKind, kv: int, block: int) -> torch.Tensor:
    """The engine's own indexing: K (kv=0) or V of one block as [block_size, heads, head]."""
    if kind is KVKind.FLASH_NHD:
        return t[kv, block]
    if kind is KVKind.FLASH_HND:
        return t[kv, block].transpose(0, 1)
    if kind is KVKind.VLLM_4D:
        d = t.shape[3] // 2
        return t[block, :, :, kv * d:(kv + 1) * d].transpose(0, 1)
    if kind is KVKind.MLA_3D:
        return t[block].unsqueeze(1)
    return t[block, 0].unsqueeze(1)


def layout_for(kind: KVKind, page_tokens: int, layers: int = 3) -> PageLayout:
    if kind.kv_factor == 1:
        return PageLayout(model=f"t-{kind.value}", num_layers=layers, page_tokens=page_tokens,
                          num_kv_heads=1, head_size=MLA_HEAD, kv_factor=1)
    return PageLayout(model=f"t-{kind.value}", num_layers=layers, page_tokens=page_tokens,
                      num_kv_heads=HEADS, head_size=HEAD)


def expected_page(caches, kind, layout, blocks_of_page) -> np.ndarray:
    """A page's bytes as the store keeps them, built from the engine tensors."""
    slabs = []
    for t in caches:
        per_kv = [torch.cat([engine_block(t, kind, kv, int(b)) for b in blocks_of_page])
                  for kv in range(layout.kv_factor)]
        slabs.append(torch.stack(per_kv).contiguous().cpu().view(torch.uint8).numpy().ravel())
    return np.concatenate(slabs)


def check_loaded(caches, kind, layout, pages: np.ndarray, block_ids: np.ndarray) -> None:
    """Every target block holds its page's bytes; every other block is still POISON."""
    for p, blocks_of_page in enumerate(block_ids):
        got = expected_page(caches, kind, layout, blocks_of_page)
        assert np.array_equal(got, pages[p]), f"page {p} differs"
    others = sorted(set(range(BLOCKS)) - set(block_ids.reshape(-1).tolist()))
    for t in caches:
        for b in others:
            for kv in range(layout.kv_factor):
                assert bool((engine_block(t, kind, kv, b).view(torch.int16) == POISON).all())


CASES = [(kind, k) for kind in KVKind for k in (1, 2)] + [("VLLM_4D_HNC", 2)]


def case(kind_or_name):
    if kind_or_name == "VLLM_4D_HNC":
        return KVKind.VLLM_4D, "HNC"
    return kind_or_name, "NHC"


def run_load(server_address, kind_or_name, k, device="cpu", dtype=torch.bfloat16,
             block_size=4, n_pages=5, seed=0, order=None, loads=1, **transfer):
    """order: the pages' order in the load (default: as stored, so adjacent in the pool);
    loads: how many times the same KVTransfer loads them; transfer: KVTransfer options."""
    kind, physical = case(kind_or_name)
    layout = layout_for(kind, k * block_size)
    rng = np.random.default_rng(seed)
    pages = rng.integers(0, 256, (n_pages, layout.page_bytes), dtype=np.uint8)
    ks = keys(f"load-{kind.value}-{physical}-{k}-{device}", n_pages)
    caches = [make_cache(kind, block_size, dtype, device, physical)
              for _ in range(layout.num_layers)]
    block_ids = rng.permutation(BLOCKS)[:n_pages * k].reshape(n_pages, k).astype(np.int64)
    with KVStoreClient(server_address, shared_memory=True) as c:
        ns = c.register_layout(layout)
        c.put(ns, ks, pages)
        mem = c.region().mem
        reg = HostRegistration(mem)
        try:
            xfer = KVTransfer([kv5(t, kind) for t in caches], layout.page_tokens, device,
                              **transfer)
            with c.acquire(ns, ks) as acq:
                offsets = acq.offsets if order is None else acq.offsets[order]
                if order is not None:
                    pages, block_ids = pages[order], block_ids
                for _ in range(loads):
                    for t in caches:        # as made: every block POISON
                        t.view(torch.int16).fill_(POISON)
                    handle = xfer.load(mem, offsets, ns.layer_bytes, block_ids)
                    for layer in range(layout.num_layers):
                        handle.wait_layer(layer)
                handle.synchronize()
                assert handle.done()
        finally:
            reg.close()
    check_loaded(caches, kind, layout, pages, block_ids)


def run_save(server_address, kind_or_name, k, device="cpu", dtype=torch.bfloat16,
             block_size=4, n_pages=5, seed=1, order=None, layers=3, **transfer):
    """order: the pages' order in the save (default: as reserved, so mostly adjacent in
    the pool); layers: the model's; transfer: KVTransfer options."""
    kind, physical = case(kind_or_name)
    layout = layout_for(kind, k * block_size, layers)
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(layout.num_layers):
        t = make_cache(kind, block_size, dtype, device, physical)
        noise = torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16, generator=gen)
        t.view(torch.int16).copy_(noise)
        caches.append(t)
    rng = np.random.default_rng(seed)
    block_ids = rng.permutation(BLOCKS)[:n_pages * k].reshape(n_pages, k).astype(np.int64)
    want = [expected_page(caches, kind, layout, b) for b in block_ids]
    # Named by the case and the options too: a test of the same case with other options
    # against the same server would otherwise find its pages already stored.
    tag = f"{layers}-{None if order is None else list(order)}-{sorted(transfer.items())}"
    ks = keys(f"save-{kind.value}-{physical}-{k}-{device}-{tag}", n_pages)
    with KVStoreClient(server_address, shared_memory=True) as c:
        ns = c.register_layout(layout)
        c.put(ns, ks[1:2], want[1][None])              # already stored: offset -1, skipped
        mem = c.region().mem
        reg = HostRegistration(mem)
        try:
            xfer = KVTransfer([kv5(t, kind) for t in caches], layout.page_tokens, device,
                              **transfer)
            res = c.reserve(ns, ks)
            assert res.offsets[1] == -1 and (np.delete(res.offsets, 1) >= 0).all()
            at = np.arange(n_pages) if order is None else np.asarray(order)
            for layer in range(layout.num_layers):
                xfer.save_layer(layer, mem, res.offsets[at], block_ids[at])
            handle = xfer.finish_save()
            assert handle.done()
            assert res.commit() == n_pages - 1
        finally:
            reg.close()
        got = c.get(ns, ks)
    for p in range(n_pages):
        assert np.array_equal(got[p], want[p]), f"page {p} differs"


# -- kv5 views ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind_or_name", list(KVKind) + ["VLLM_4D_HNC"])
def test_kv5_writes_through_to_the_engine_tensor(kind_or_name):
    kind, physical = case(kind_or_name)
    t = make_cache(kind, 4, torch.float32, physical=physical)
    view = kv5(t, kind)
    heads = 1 if kind.kv_factor == 1 else HEADS
    head = MLA_HEAD if kind.kv_factor == 1 else HEAD
    assert tuple(view.shape) == (kind.kv_factor, BLOCKS, 4, heads, head)
    assert view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    rng = np.random.default_rng(3)
    for _ in range(20):
        kv, b, n, h, d = (int(rng.integers(s)) for s in view.shape)
        value = float(rng.integers(1, 1000))
        view[kv, b, n, h, d] = value
        assert engine_block(t, kind, kv, b)[n, h, d].item() == value


def test_kv5_rejects_wrong_shapes():
    with pytest.raises(ValueError):
        kv5(torch.zeros(3, 4, 4, 2, 8), KVKind.FLASH_NHD)
    with pytest.raises(ValueError):
        kv5(torch.zeros(4, 2, 4, 7), KVKind.VLLM_4D)
    with pytest.raises(ValueError):
        kv5(torch.zeros(4, 2, 4, 8), KVKind.MLA_VLLM_4D)
    with pytest.raises(ValueError):
        kv5(torch.zeros(4, 4, 8), KVKind.FLASH_NHD)


def test_detect_kind():
    assert detect_kind(torch.zeros(2, 4, 16, 8, 64)) is KVKind.FLASH_NHD
    assert detect_kind(torch.zeros(2, 4, 8, 16, 64), block_size=16) is KVKind.FLASH_HND
    assert detect_kind(torch.zeros(2, 4, 8, 16, 64), num_kv_heads=8) is KVKind.FLASH_HND
    assert detect_kind(torch.zeros(4, 8, 16, 128)) is KVKind.VLLM_4D
    assert detect_kind(torch.zeros(4, 16, 576), mla=True) is KVKind.MLA_3D
    assert detect_kind(torch.zeros(4, 1, 16, 576), mla=True) is KVKind.MLA_VLLM_4D
    for bad, kw in [(torch.zeros(4, 8, 16, 127), {}), (torch.zeros(4, 16, 64), {}),
                    (torch.zeros(4, 2, 16, 576), {"mla": True}),
                    (torch.zeros(2, 4, 16, 8, 64), {"block_size": 32}),
                    (torch.zeros(4, 8, 16, 128), {"num_kv_heads": 4})]:
        with pytest.raises(ValueError):
            detect_kind(bad, **kw)


# -- loads and saves through the store's pool -----------------------------------------------
@pytest.mark.parametrize("kind_or_name,k", CASES)
def test_load_pages_into_random_blocks(server, kind_or_name, k):
    run_load(server.address, kind_or_name, k)


@pytest.mark.parametrize("kind_or_name,k", CASES)
def test_save_blocks_into_reserved_slots(server, kind_or_name, k):
    run_save(server.address, kind_or_name, k)


def test_host_registration_is_a_no_op_without_cuda():
    mem = np.zeros(4096, dtype=np.uint8)
    with HostRegistration(mem) as reg:
        assert reg.registered == torch.cuda.is_available()


# -- refusals ---------------------------------------------------------------------------------
def _xfer(block_size=4, k=2, layers=2):
    caches = [make_cache(KVKind.FLASH_NHD, block_size) for _ in range(layers)]
    layout = layout_for(KVKind.FLASH_NHD, k * block_size, layers)
    return KVTransfer([kv5(t, KVKind.FLASH_NHD) for t in caches], k * block_size), layout, caches


def test_bad_inputs_raise_and_write_nothing():
    xfer, layout, caches = _xfer()
    lb, extent = layout.layer_bytes, layout.page_bytes
    host = np.zeros(3 * extent, dtype=np.uint8)
    ok_blocks = np.array([[0, 1], [2, 3]])
    bad = [
        (np.array([0, 2 * extent + 1]), ok_blocks, lb),     # runs past the end
        (np.array([-1, 0]), ok_blocks, lb),                 # negative (loads skip nothing)
        (np.array([0, extent]), np.array([[0, 1], [2, BLOCKS]]), lb),   # no such block
        (np.array([0, extent]), np.array([[0, 1], [1, 3]]), lb),        # block twice
        (np.array([0, extent]), np.array([0, 1]), lb),                  # not (pages, k)
        (np.array([0, extent]), ok_blocks, lb + 2),                     # wrong layer size
        (np.array([2 * extent, 3 * extent]), ok_blocks, lb),  # back to back, past the end
        (np.array([-extent, 0]), ok_blocks, lb),              # back to back, from before
    ]
    for offsets, blocks, layer_bytes in bad:
        with pytest.raises(ValueError):
            xfer.load(host, offsets, layer_bytes, blocks)
    with pytest.raises(ValueError):                      # overlapping pages
        xfer.save_layer(0, host, np.array([0, extent - 2]), ok_blocks)
    with pytest.raises(ValueError):                      # not uint8
        xfer.save_layer(0, host.view(np.int16), np.array([0]), ok_blocks[:1])
    with pytest.raises(IndexError):
        xfer.save_layer(2, host, np.array([0]), ok_blocks[:1])
    read_only = host.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError):
        xfer.save_layer(0, read_only, np.array([0]), ok_blocks[:1])
    assert not host.any()
    for t in caches:
        assert bool((t.view(torch.int16) == POISON).all())


def test_a_save_batch_saves_what_save_layer_saves_and_ends_at_finish_save():
    """save_batch plans the pages once, save_into copies each layer: the same bytes as
    save_layer's (pages out of order, one already stored); after finish_save the batch
    is refused, since its index may be overwritten by the next save's."""
    xfer, layout, caches = _xfer(layers=3)
    for t in caches:
        t.view(torch.int16).copy_(torch.arange(t.numel(), dtype=torch.int16).view(t.shape))
    offsets = np.array([2 * layout.page_bytes, -1, 0])
    blocks = np.array([[4, 5], [0, 1], [2, 3]])
    by_layer = np.zeros(3 * layout.page_bytes, dtype=np.uint8)
    by_batch = np.zeros_like(by_layer)
    for layer in range(3):
        xfer.save_layer(layer, by_layer, offsets, blocks)
    xfer.finish_save()
    batch = xfer.save_batch(by_batch, offsets, blocks)
    with pytest.raises(IndexError):
        xfer.save_into(batch, 3)
    for layer in range(3):
        xfer.save_into(batch, layer)
    xfer.finish_save()
    assert by_layer.any() and np.array_equal(by_batch, by_layer)
    assert not by_batch[layout.page_bytes:2 * layout.page_bytes].any()   # the skipped page
    with pytest.raises(ValueError, match="finish_save"):
        xfer.save_into(batch, 0)


def test_long_block_id_lists_are_checked_too():
    """Past plan._IDS_IN_PYTHON ids the checks go by numpy: the same errors."""
    xfer, layout, _ = _xfer()
    pages = 600                                          # 1,200 ids at k = 2
    host = np.zeros(pages * layout.page_bytes, dtype=np.uint8)
    offsets = np.arange(pages) * layout.page_bytes
    in_range = np.arange(2 * pages).reshape(pages, 2) % BLOCKS      # repeats, in range
    with pytest.raises(ValueError, match="repeat a block"):
        xfer.load(host, offsets, layout.layer_bytes, in_range)
    with pytest.raises(ValueError, match="block ids must be in"):
        xfer.load(host, offsets, layout.layer_bytes, in_range + BLOCKS)
    with pytest.raises(ValueError, match="overlap"):
        xfer.save_layer(0, host, offsets[::-1] // 2, in_range)
    assert not host.any()


def test_geometry_is_checked():
    caches = [make_cache(KVKind.FLASH_NHD, 4) for _ in range(2)]
    with pytest.raises(ValueError):                      # page not a multiple of blocks
        KVTransfer([kv5(t, KVKind.FLASH_NHD) for t in caches], 6)
    with pytest.raises(ValueError):                      # layers of different shapes
        KVTransfer([kv5(caches[0], KVKind.FLASH_NHD),
                    kv5(make_cache(KVKind.FLASH_NHD, 8), KVKind.FLASH_NHD)], 8)
    with pytest.raises(ValueError):                      # head not contiguous
        KVTransfer([caches[0].transpose(3, 4)], 8)


def test_save_with_every_page_already_stored_is_a_no_op():
    xfer, layout, _ = _xfer()
    host = np.zeros(2 * layout.page_bytes, dtype=np.uint8)
    xfer.save_layer(0, host, np.array([-1, -1]), np.array([[0, 1], [2, 3]]))
    assert xfer.finish_save().done()
    assert not host.any()
