"""The reference engine's model: a step over the paged cache equals a full recompute."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore_bench.engine.model import (  # noqa: E402 - after the torch skip
    PRESETS,
    LlamaModel,
    ModelConfig,
    SeqStep,
)
from kvstore_bench.engine.paged_cache import (  # noqa: E402
    allocate_kv_caches,
    gather_kv,
    layer_name,
    slot_mapping,
    write_kv,
)

BLOCK = 16
NUM_BLOCKS = 32
PROMPT_LEN = 45  # not a multiple of BLOCK
PREFIX_LEN = 32  # a stored prefix is whole pages
DECODE_STEPS = 6
TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(ModelConfig.preset("tiny"), device="cpu", dtype=torch.float32, seed=1234)


@pytest.fixture(scope="module")
def prompt(model: LlamaModel) -> list[int]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, model.config.vocab_size, (PROMPT_LEN,), generator=gen).tolist()


def new_cache(model: LlamaModel, noise: bool = False) -> dict[str, torch.Tensor]:
    caches = allocate_kv_caches(model.cache_spec(NUM_BLOCKS, BLOCK), dtype=model.dtype,
                                device=model.device)
    if noise:  # stale data in every slot: anything read by mistake shows in the logits
        gen = torch.Generator().manual_seed(99)
        for t in caches.values():
            t.normal_(0.0, 3.0, generator=gen)
    return caches


def run_chunks(model, caches, tokens, blocks, chunks, start=0):
    """Feed ``tokens[start:]`` in chunks of the given sizes; return (all logits, last logits)."""
    rows, pos = [], start
    for size in chunks:
        out = model([SeqStep(tokens[pos:pos + size], pos, blocks)], caches, all_logits=True)
        rows.append(out.all_logits)
        pos += size
    assert pos == len(tokens)
    return torch.cat(rows), out.logits[0]


def greedy(model, caches, blocks, context_len, logits, steps=DECODE_STEPS):
    """Greedy-decode ``steps`` tokens; return the tokens and each step's logits."""
    tokens, all_logits = [], []
    for _ in range(steps):
        token = int(logits.argmax())
        tokens.append(token)
        logits = model([SeqStep([token], context_len, blocks)], caches).logits[0]
        all_logits.append(logits)
        context_len += 1
    return tokens, torch.stack(all_logits)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def reference(model, prompt):
    """One prefill of the whole prompt, then greedy decode."""
    caches, blocks = new_cache(model), [3, 9, 4, 11]
    out = model([SeqStep(prompt, 0, blocks)], caches, all_logits=True)
    decoded = greedy(model, caches, blocks, PROMPT_LEN, out.logits[0])
    return out.all_logits, out.logits[0], decoded


def test_presets_have_the_published_shapes():
    one_b, eight_b = PRESETS["1b"], PRESETS["8b"]
    assert (one_b.num_layers, one_b.hidden_size, one_b.num_heads, one_b.num_kv_heads,
            one_b.head_size, one_b.intermediate_size, one_b.vocab_size) == (
        16, 2048, 32, 8, 64, 8192, 128256)
    assert (eight_b.num_layers, eight_b.hidden_size, eight_b.num_heads, eight_b.num_kv_heads,
            eight_b.head_size, eight_b.intermediate_size, eight_b.vocab_size) == (
        32, 4096, 32, 8, 128, 14336, 128256)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("70b")


def test_weights_are_deterministic_per_seed(model):
    same = LlamaModel(model.config, seed=1234)
    other = LlamaModel(model.config, seed=1235)
    for (name, a), b, c in zip(model.named_parameters(), same.parameters(), other.parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
        assert a.dim() == 1 or not torch.equal(a, c), name


def test_write_then_gather_round_trips_through_scattered_blocks():
    spec = ModelConfig.preset("tiny").cache_spec(num_blocks=8, block_size=4)
    kv = allocate_kv_caches(spec, dtype=torch.float32, device="cpu")[layer_name(0)]
    table = torch.tensor([[5, 2, 7]])
    positions = torch.arange(10)
    slots = slot_mapping(table, torch.zeros(10, dtype=torch.long), positions, 4)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    key, value = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    write_kv(kv, slots, key, value)
    assert torch.equal(kv[0, 2, 1], key[5]) and torch.equal(kv[1, 7, 1], value[9])
    got = gather_kv(kv, table[0], 10)
    assert torch.equal(got[0], key) and torch.equal(got[1], value)


def test_chunked_prefill_equals_one_prefill(model, prompt, reference):
    ref_all, ref_last, (ref_tokens, ref_decode) = reference
    caches, blocks = new_cache(model, noise=True), [7, 1, 30, 12]
    # Chunk edges inside blocks and on block edges; a 1-token chunk is a decode-shaped step.
    all_logits, last = run_chunks(model, caches, prompt, blocks, [10, 6, 1, 17, 11])
    assert max_diff(all_logits, ref_all) < TOL
    assert max_diff(last, ref_last) < TOL
    tokens, decode_logits = greedy(model, caches, blocks, PROMPT_LEN, last)
    assert tokens == ref_tokens
    assert max_diff(decode_logits, ref_decode) < TOL


def copy_blocks(src, dst, src_blocks, dst_blocks):
    """What a connector load does: whole blocks of every layer land at other block ids."""
    src_ids, dst_ids = torch.tensor(src_blocks), torch.tensor(dst_blocks)
    for name, t in src.items():
        dst[name].index_copy_(1, dst_ids, t.index_select(1, src_ids))


def test_prefix_loaded_into_other_blocks_equals_one_prefill(model, prompt, reference):
    ref_all, ref_last, (ref_tokens, ref_decode) = reference
    first = new_cache(model)
    model([SeqStep(prompt[:PREFIX_LEN], 0, [0, 1])], first)
    second, blocks = new_cache(model, noise=True), [21, 6, 14, 25]
    copy_blocks(first, second, [0, 1], blocks[:2])
    out = model([SeqStep(prompt[PREFIX_LEN:], PREFIX_LEN, blocks)], second, all_logits=True)
    assert max_diff(out.all_logits, ref_all[PREFIX_LEN:]) < TOL
    assert max_diff(out.logits[0], ref_last) < TOL
    tokens, decode_logits = greedy(model, second, blocks, PROMPT_LEN, out.logits[0])
    assert tokens == ref_tokens
    assert max_diff(decode_logits, ref_decode) < TOL


def test_loaded_prefix_is_bitwise_equal_to_a_local_one_of_the_same_step_shapes(model, prompt):
    """Only the block ids differ, so nothing may differ: this exactness holds in bf16 too,
    where a different chunking (different GEMM shapes) moves logits by a few bf16 ulps."""
    local = new_cache(model)
    model([SeqStep(prompt[:PREFIX_LEN], 0, [0, 1])], local)
    want = model([SeqStep(prompt[PREFIX_LEN:], PREFIX_LEN, [0, 1, 2])], local, all_logits=True)
    loaded, blocks = new_cache(model, noise=True), [17, 3, 28]
    copy_blocks(local, loaded, [0, 1], blocks[:2])
    got = model([SeqStep(prompt[PREFIX_LEN:], PREFIX_LEN, blocks)], loaded, all_logits=True)
    assert torch.equal(got.all_logits, want.all_logits)


def test_batch_equals_each_request_alone(model, prompt, reference):
    ref_all, ref_last, _ = reference
    other = list(reversed(prompt))[:23]
    alone = model([SeqStep(other, 0, [2, 5])], new_cache(model), all_logits=True)
    # One request prefills from a cached prefix, the other from scratch, in one step.
    caches = new_cache(model, noise=True)
    model([SeqStep(prompt[:PREFIX_LEN], 0, [8, 3])], caches)
    out = model([SeqStep(other, 0, [10, 0]), SeqStep(prompt[PREFIX_LEN:], PREFIX_LEN, [8, 3, 9])],
                caches, all_logits=True)
    assert max_diff(out.logits[0], alone.logits[0]) < TOL
    assert max_diff(out.logits[1], ref_last) < TOL
    assert max_diff(out.all_logits[:23], alone.all_logits) < TOL
    assert max_diff(out.all_logits[23:], ref_all[PREFIX_LEN:]) < TOL
    # Decodes of different context lengths share one attention call; here they sit around a
    # prefill, so their rows in the step are not contiguous.
    a = SeqStep([int(out.logits[1].argmax())], PROMPT_LEN, [8, 3, 9])
    b = SeqStep([int(out.logits[0].argmax())], 23, [10, 0])
    c = SeqStep(prompt[:20], 0, [1, 2])
    for batch in ([a, b], [a, c, b]):
        together = model(batch, caches).logits
        for got, seq in zip(together, batch, strict=True):
            assert max_diff(got, model([seq], caches).logits[0]) < TOL


class RecordingHooks:
    def __init__(self, on_wait=None):
        self.calls: list[tuple[str, str, torch.Tensor | None]] = []
        self.on_wait = on_wait

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait", layer_name, None))
        if self.on_wait is not None:
            self.on_wait(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.calls.append(("save", layer_name, kv_layer))


def test_hooks_are_called_once_per_layer_in_order(model, prompt):
    caches, hooks = new_cache(model), RecordingHooks()
    model([SeqStep(prompt, 0, [0, 1, 2])], caches, hooks)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.config.num_layers)]
    assert [(kind, name) for kind, name, _ in hooks.calls] == [
        (kind, name) for name in names for kind in ("wait", "save")]
    for kind, name, tensor in hooks.calls:
        assert kind == "wait" or tensor is caches[name]


def test_layer_load_landing_at_the_wait_is_used(model, prompt, reference):
    """The model reads each layer's cache only after its wait: a load may finish just then."""
    _, ref_last, _ = reference
    first = new_cache(model)
    model([SeqStep(prompt[:PREFIX_LEN], 0, [0, 1])], first)
    second, blocks = new_cache(model, noise=True), [4, 19, 2]
    src, dst = torch.tensor([0, 1]), torch.tensor(blocks[:2])

    def land(name: str) -> None:
        second[name].index_copy_(1, dst, first[name].index_select(1, src))

    out = model([SeqStep(prompt[PREFIX_LEN:], PREFIX_LEN, blocks)], second, RecordingHooks(land))
    assert max_diff(out.logits[0], ref_last) < TOL


def test_bad_inputs_are_rejected(model, prompt):
    caches = new_cache(model)
    with pytest.raises(ValueError, match="cannot hold"):
        model([SeqStep(prompt, 0, [0, 1])], caches)
    with pytest.raises(ValueError, match="block ids"):
        model([SeqStep(prompt, 0, [0, 1, NUM_BLOCKS])], caches)
    with pytest.raises(ValueError, match="new token"):
        model([SeqStep([], 3, [0])], caches)
    with pytest.raises(ValueError, match="no tensor for layer"):
        model([SeqStep(prompt, 0, [0, 1, 2])], {layer_name(0): caches[layer_name(0)]})
