"""Llama 3 target: logit parity with transformers' LlamaForCausalLM (fp32, max abs diff <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tandem.models import ForwardBatch, load_target
from tandem.models.config import RopeParameters
from tandem.models.rope import MAX_ROTATION_MATRIX_TOKENS, HalfSplitRotation, Rotary, RotationMatrices, rope_inv_freq

TOL = 1e-4


def hf_forward(model, ids: list[int]):
    """transformers' logits ``[L, V]`` and hidden_states (L+1 entries of ``[L, H]``) of one sequence."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def sequences(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(
    scope="module",
    params=[
        dict(),  # GQA, llama3 RoPE scaling, untied head
        dict(
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            num_key_value_heads=4,
            attention_bias=True,
        ),
        dict(max_shard_size="60KB"),  # sharded save with model.safetensors.index.json
    ],
    ids=["gqa-llama3rope", "tied-mha-bias", "sharded"],
)
def pair(request, tmp_path_factory, save_llama):
    """(our target, the transformers model) over the same saved weights."""
    path = tmp_path_factory.mktemp("llama")
    hf = save_llama(path, **request.param)
    if "max_shard_size" in request.param:
        assert (path / "model.safetensors.index.json").is_file()
    return load_target(path), hf


def test_prefill_of_a_ragged_batch_matches_transformers(pair):
    target, hf = pair
    rows = sequences(1, [7, 3, 12])
    cache = target.new_cache(num_slots=4, max_len=32)
    batch = ForwardBatch.from_rows(rows, starts=[0, 0, 0], slots=[2, 0, 3])
    logits = target.forward(batch, cache).logits
    expected = torch.cat([hf_forward(hf, row)[0] for row in rows])
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    assert max_diff(logits, expected) <= TOL
    assert cache.lengths == [3, 0, 7, 12]


@pytest.mark.parametrize("slot_a, slot_b", [(1, 0), (0, 1)])  # keys gathered / read as a view of the cache
def test_incremental_decode_and_verify_chunks_match_transformers(pair, slot_a, slot_b):
    target, hf = pair
    (full_a, full_b) = sequences(2, [16, 12])
    cache = target.new_cache(num_slots=2, max_len=32)
    target.forward(ForwardBatch.from_rows([full_a[:5], full_b[:8]], [0, 0], [slot_a, slot_b]), cache)
    ref_a, ref_b = hf_forward(hf, full_a)[0], hf_forward(hf, full_b)[0]
    pos_a, pos_b = 5, 8
    # single-token decodes and k+1 verify chunks, equal (no padding) and ragged, two rows and one
    for step_a, step_b in [(1, 1), (4, 1), (2, 2), (3, 0), (1, 0)]:
        rows, starts, slots, refs = [], [], [], []
        for step, pos, full, ref, slot in (
            (step_a, pos_a, full_a, ref_a, slot_a),
            (step_b, pos_b, full_b, ref_b, slot_b),
        ):
            if step:
                rows.append(full[pos : pos + step]), starts.append(pos), slots.append(slot)
                refs.append(ref[pos : pos + step])
        logits = target.forward(ForwardBatch.from_rows(rows, starts, slots), cache).logits
        assert max_diff(logits, torch.cat(refs)) <= TOL
        pos_a, pos_b = pos_a + step_a, pos_b + step_b


def test_a_prefill_longer_than_the_rotation_matrices_matches_transformers(pair):
    """Past MAX_ROTATION_MATRIX_TOKENS tokens the rotation is elementwise; a long prefill and the
    decode step after it (matrices again) both match."""
    target, hf = pair
    (row,) = sequences(7, [MAX_ROTATION_MATRIX_TOKENS + 20])
    cache = target.new_cache(num_slots=1, max_len=len(row))
    prefill = target.forward(ForwardBatch.from_rows([row[:-1]], [0], [0]), cache).logits
    decode = target.forward(ForwardBatch.from_rows([row[-1:]], [len(row) - 1], [0]), cache).logits
    assert max_diff(torch.cat([prefill, decode]), hf_forward(hf, row)[0]) <= TOL


def test_rotation_matrices_and_elementwise_rotation_agree(llama3_rope):
    rope = RopeParameters.from_dict({"rope_parameters": llama3_rope})
    rotary, positions = Rotary(rope, 16, torch.float32), torch.arange(200)
    x = torch.randn(len(positions), 3, 16)
    by_matrix = torch.cat([rotary(positions[i : i + 8], i + 8).apply(x[i : i + 8]) for i in range(0, 200, 8)])
    elementwise = rotary(positions, 200).apply(x)
    assert isinstance(rotary(positions, 200), HalfSplitRotation)
    assert isinstance(rotary(positions[:8], 8), RotationMatrices)
    torch.testing.assert_close(by_matrix, elementwise)


def test_logits_indices_select_rows_of_the_full_logits(pair):
    target, _ = pair
    rows = sequences(3, [6, 4])
    full = target.forward(ForwardBatch.from_rows(rows, [0, 0], [0, 1]), target.new_cache(2, 16)).logits
    picked = ForwardBatch.from_rows(rows, [0, 0], [0, 1], logits_indices=[5, 9, 0])
    assert max_diff(target.forward(picked, target.new_cache(2, 16)).logits, full[[5, 9, 0]]) <= 1e-6


def test_truncate_and_redecode_equals_a_fresh_cache_and_transformers(pair):
    target, hf = pair
    committed, rejected, replacement = sequences(4, [9, 5, 4])
    cache = target.new_cache(num_slots=1, max_len=32)
    target.forward(ForwardBatch.from_rows([committed + rejected], [0], [0]), cache)
    cache.truncate([0], [len(committed)])
    redecoded = target.forward(ForwardBatch.from_rows([replacement], [len(committed)], [0]), cache).logits

    fresh_cache = target.new_cache(num_slots=1, max_len=32)
    fresh = target.forward(ForwardBatch.from_rows([committed + replacement], [0], [0]), fresh_cache).logits
    assert max_diff(redecoded, fresh[len(committed) :]) <= TOL
    assert max_diff(redecoded, hf_forward(hf, committed + replacement)[0][len(committed) :]) <= TOL


def test_hidden_is_the_normed_last_layer_and_aux_the_layer_inputs(pair):
    target, hf = pair
    (row,) = sequences(5, [10])
    target.aux_layer_ids = (1, 2, target.num_layers)
    out = target.forward(
        ForwardBatch.from_rows([row], [0], [0]), target.new_cache(1, 16), return_hidden=True, return_aux=True
    )
    _, hidden_states = hf_forward(hf, row)
    assert max_diff(out.hidden, hidden_states[-1]) <= TOL
    assert max_diff(out.aux_hidden, torch.cat([hidden_states[i] for i in target.aux_layer_ids], -1)) <= TOL
    assert max_diff(target.lm_head(out.hidden), hf_forward(hf, row)[0]) <= TOL


def test_bfloat16_load_runs_in_bfloat16_close_to_fp32(llama_dir):
    fp32, bf16 = load_target(llama_dir), load_target(llama_dir, dtype="bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    (row,) = sequences(6, [8])
    batch = ForwardBatch.from_rows([row], [0], [0])
    out16 = bf16.forward(batch, bf16.new_cache(1, 8), return_hidden=True)
    out32 = fp32.forward(batch, fp32.new_cache(1, 8))
    assert out16.logits.dtype == torch.float32 and out16.hidden.dtype == torch.bfloat16
    assert max_diff(out16.logits, out32.logits) < 0.1


def test_legacy_rope_scaling_keys_give_the_same_frequencies(llama3_rope):
    legacy = {"rope_theta": 10000.0, "rope_scaling": {k: v for k, v in llama3_rope.items() if k != "rope_theta"}}

    def inv_freq(config):
        return rope_inv_freq(RopeParameters.from_dict(config), 16)

    assert torch.equal(inv_freq(legacy), inv_freq({"rope_parameters": llama3_rope}))
    assert not torch.equal(inv_freq(legacy), inv_freq({"rope_theta": 10000.0}))


def test_cache_rejects_a_row_that_skips_positions(llama_dir):
    target = load_target(llama_dir)
    cache = target.new_cache(num_slots=2, max_len=8)
    target.forward(ForwardBatch.from_rows([[1, 2, 3]], [0], [1]), cache)
    with pytest.raises(ValueError, match=r"row 0 \(slot 1\) writes positions 5..5 but the slot holds 3"):
        target.forward(ForwardBatch.from_rows([[4]], [5], [1]), cache)
    with pytest.raises(ValueError, match="max_len is 8"):
        target.forward(ForwardBatch.from_rows([list(range(9))], [0], [0]), cache)
