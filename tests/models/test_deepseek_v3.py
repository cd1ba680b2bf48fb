"""DeepSeek-V3 target: logit parity with transformers' DeepseekV3ForCausalLM (fp32, max abs diff <= 1e-4)
over prefill, cached decode and truncate-and-redecode; latent-only cache; routing; expert dispatch; loader errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tandem.models import CheckpointError, ForwardBatch, load_target, moe
from tandem.models import config as model_config
from tandem.models.deepseek_v3 import softmax_attention
from tandem.models.rope import MAX_ROTATION_MATRIX_TOKENS, InterleavedRotation, RotaryEmbedding, RotationMatrices

TOLERANCE = 1e-4
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
    "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0,
}  # fmt: skip


def tiny_config(**overrides) -> DeepseekV3Config:
    """Hidden 64, 3 layers (first dense), 8 routed experts in 4 groups, top-2 from 2 groups, 1 shared."""
    settings = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=128, rope_parameters=dict(YARN),
    )  # fmt: skip
    settings.update(overrides)
    return DeepseekV3Config(**settings)


def rope_settings(rope_parameters: dict | None) -> model_config.RopeParameters:
    """The typed RoPE settings of a DeepSeek config with these ``rope_parameters`` (128 positions)."""
    return model_config.RopeParameters.from_dict({"rope_parameters": rope_parameters, "max_position_embeddings": 128})


def save_reference(path: Path, config: DeepseekV3Config, *, seed: int = 0, **save_kwargs) -> DeepseekV3ForCausalLM:
    """A random HF model with non-zero routing correction biases, saved to ``path``."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    model.save_pretrained(path, **save_kwargs)
    return model


def reference_logits(model: DeepseekV3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]`` logits of a cache-less full-sequence forward."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours - ref).abs().max().item()


@pytest.mark.parametrize(
    "variant, overrides, save_kwargs",
    [
        ("q_lora+yarn, sharded", {}, {"max_shard_size": "100KB"}),
        ("q_proj+default rope, tied", {"q_lora_rank": None, "rope_parameters": None, "tie_word_embeddings": True}, {}),
        ("unnormalised top-k weights", {"norm_topk_prob": False, "routed_scaling_factor": 1.0}, {}),
    ],
)
def test_prefill_decode_truncate_match_transformers(tmp_path, variant, overrides, save_kwargs):
    reference = save_reference(tmp_path, tiny_config(**overrides), **save_kwargs)
    if save_kwargs:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_target(tmp_path)
    cache = model.new_cache(num_slots=3, max_len=32)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 5)]
    slots = [2, 0]

    # Prefill both rows in one ragged batch.
    out = model.forward(ForwardBatch.from_rows(seqs, [0, 0], slots), cache)
    assert out.logits.dtype == torch.float32
    for b, ref in enumerate(reference_logits(reference, s) for s in seqs):
        start = 0 if b == 0 else len(seqs[0])
        assert max_diff(out.logits[start : start + len(seqs[b])], ref) <= TOLERANCE, (variant, b)

    # Decode: row 0 one token per step, row 1 a verify-like chunk of 3; then equal chunks (no padding).
    for step, (n0, n1) in enumerate([(1, 3), (1, 3), (2, 2)]):
        new = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (n0, n1)]
        starts = [len(s) for s in seqs]
        out = model.forward(ForwardBatch.from_rows(new, starts, slots), cache)
        seqs = [s + n for s, n in zip(seqs, new)]
        assert max_diff(out.logits[:n0], reference_logits(reference, seqs[0])[-n0:]) <= TOLERANCE, (variant, step)
        assert max_diff(out.logits[n0:], reference_logits(reference, seqs[1])[-n1:]) <= TOLERANCE, (variant, step)

    # Reject the last 2 tokens of row 1, decode others in their place: a chunk, then a single token.
    seqs[1] = seqs[1][:-2]
    cache.truncate([0], [len(seqs[1])])
    for new in ([7, 8], [9]):
        out = model.forward(ForwardBatch.from_rows([new], [len(seqs[1])], [0]), cache)
        seqs[1] += new
        assert max_diff(out.logits, reference_logits(reference, seqs[1])[-len(new) :]) <= TOLERANCE, variant


def test_decode_after_truncate_equals_fresh_cache(tmp_path):
    save_reference(tmp_path, tiny_config())
    model = load_target(tmp_path)
    committed, rejected, redo = [5, 17, 250, 3, 99], [41, 42, 43], [60, 61]
    cache = model.new_cache(num_slots=1, max_len=16)
    model.forward(ForwardBatch.from_rows([committed + rejected], [0], [0]), cache)
    cache.truncate([0], [len(committed)])
    after_truncate = model.forward(ForwardBatch.from_rows([redo], [len(committed)], [0]), cache).logits

    fresh = model.new_cache(num_slots=1, max_len=16)
    model.forward(ForwardBatch.from_rows([committed], [0], [0]), fresh)
    from_fresh = model.forward(ForwardBatch.from_rows([redo], [len(committed)], [0]), fresh).logits
    assert max_diff(after_truncate, from_fresh) <= 1e-5


def test_a_prefill_longer_than_the_rotation_matrices_matches_transformers(tmp_path):
    """Past MAX_ROTATION_MATRIX_TOKENS tokens the rotation is elementwise; a long prefill and the
    decode step after it (matrices, and the one-token expert path) both match."""
    reference = save_reference(tmp_path, tiny_config())
    model = load_target(tmp_path)
    row = torch.randint(0, 512, (MAX_ROTATION_MATRIX_TOKENS + 20,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = model.new_cache(num_slots=1, max_len=len(row))
    prefill = model.forward(ForwardBatch.from_rows([row[:-1]], [0], [0]), cache).logits
    decode = model.forward(ForwardBatch.from_rows([row[-1:]], [len(row) - 1], [0]), cache).logits
    assert max_diff(torch.cat([prefill, decode]), reference_logits(reference, row)) <= TOLERANCE


@pytest.mark.parametrize("rope_parameters", [dict(YARN), None])
def test_interleaved_rotation_matrices_and_elementwise_rotation_agree(rope_parameters):
    rope = RotaryEmbedding(rope_settings(rope_parameters), 8, torch.float32)
    positions = torch.arange(200)
    x = torch.randn(len(positions), 3, 8, generator=torch.Generator().manual_seed(0))
    by_matrix = torch.cat([rope(positions[i : i + 8], i + 8).apply(x[i : i + 8]) for i in range(0, 200, 8)])
    elementwise = rope(positions, 200).apply(x)
    assert isinstance(rope(positions, 200), InterleavedRotation)
    assert isinstance(rope(positions[:8], 8), RotationMatrices)
    torch.testing.assert_close(by_matrix, elementwise)


def test_the_rotary_table_grows_to_the_furthest_position_with_the_same_angles():
    """The table starts at 256 positions and doubles past them; every entry is YaRN's scaled cos/sin."""
    rope = RotaryEmbedding(rope_settings(dict(YARN)), 8, torch.float32)
    rope(torch.arange(4), 4)
    assert len(rope.table) == 256
    positions = torch.cat([torch.tensor([3, 255, 256, 700]), torch.arange(100)])  # past 64: (cos, sin) come back
    rotation = rope(positions, 701)
    cos, sin = rotation.cos, rotation.sin
    assert len(rope.table) == 701
    angles = positions.float()[:, None] * rope.inv_freq
    torch.testing.assert_close(cos[:, :4], angles.cos() * rope.attention_factor)
    torch.testing.assert_close(sin[:, 4:], angles.sin() * rope.attention_factor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_equal_the_dispatch_for_every_batch(dtype):
    """Running every expert on every token, weighted by the routing (0 where not chosen), computes what
    running each expert on its tokens does, for each token alone and in any batch."""
    experts = moe.RoutedExperts(16, 8, 6, dtype=dtype).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    experts.gate_up.copy_(torch.randn(experts.gate_up.shape, generator=g))
    experts.down.copy_(torch.randn(experts.down.shape, generator=g))
    x = torch.randn(3, 16, generator=g).to(dtype)
    weights, picked = torch.rand(3, 2, generator=g), torch.tensor([[4, 1], [0, 5], [3, 2]])
    together = experts.dispatch(x, weights, picked)
    scale = together.abs().max().item()  # bfloat16 rounds the scaled units, the dispatch the unscaled ones
    tolerance = {} if dtype == torch.float32 else {"rtol": 0, "atol": 0.01 * scale}
    torch.testing.assert_close(experts.dense(x, weights, picked), together, **tolerance)
    for i in range(3):
        torch.testing.assert_close(
            experts.dense(x[i : i + 1], weights[i : i + 1], picked[i : i + 1]), together[i : i + 1], **tolerance
        )


def test_experts_run_densely_on_the_cpu_for_a_few_tokens_only(monkeypatch):
    experts = moe.RoutedExperts(16, 8, 6).requires_grad_(False)  # 4 unchosen experts: 3072 extra FLOPs a token
    ran = []
    for path in ("dense", "dispatch"):
        monkeypatch.setattr(experts, path, lambda *args, path=path: ran.append((path, len(args[0]))))
    monkeypatch.setattr(moe, "DENSE_MAX_EXTRA_FLOPS", 3072 * 5)
    for tokens in (1, 5, 6):
        experts(torch.randn(tokens, 16), torch.rand(tokens, 2), torch.zeros(tokens, 2, dtype=torch.int64))
    experts(
        torch.randn(1, 16, device="meta"),
        torch.rand(1, 2, device="meta"),
        torch.zeros(1, 2, dtype=torch.int64, device="meta"),
    )
    assert ran == [("dense", 1), ("dense", 5), ("dispatch", 6), ("dispatch", 1)]


def test_cache_holds_only_the_compressed_latent_and_is_never_expanded(tmp_path):
    save_reference(tmp_path, tiny_config())
    model = load_target(tmp_path)
    cache = model.new_cache(num_slots=2, max_len=16)
    assert len(cache.layers) == 3
    assert all(layer.shape == (2, 16, 32 + 8) for layer in cache.layers)  # kv_lora_rank + qk_rope_head_dim

    def expanded(module, args):
        raise AssertionError("kv_b_proj applied to latents: the cache is being re-expanded")

    for layer in model.layers:  # the absorbed form only reads kv_b_proj's weight
        layer.self_attn.kv_b_proj.register_forward_pre_hook(expanded)
    model.forward(ForwardBatch.from_rows([[1, 2, 3], [4]], [0, 0], [0, 1]), cache)
    model.forward(ForwardBatch.from_rows([[5], [6, 7]], [3, 1], [0, 1]), cache)


def test_hidden_and_aux_hidden_match_transformers_hidden_states(tmp_path):
    reference = save_reference(tmp_path, tiny_config())
    model = load_target(tmp_path)
    model.aux_layer_ids = (0, 1, 2)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    out = model.forward(
        ForwardBatch.from_rows([tokens], [0], [0], logits_indices=[7]),
        model.new_cache(1, 16),
        return_hidden=True,
        return_aux=True,
    )
    with torch.no_grad():
        ref = reference(torch.tensor([tokens]), output_hidden_states=True)
    assert out.logits.shape == (1, 512)
    assert max_diff(out.logits, ref.logits[0, -1:]) <= TOLERANCE
    assert max_diff(out.hidden, ref.hidden_states[-1][0]) <= TOLERANCE  # after the final norm
    assert max_diff(out.aux_hidden, torch.cat([ref.hidden_states[i][0] for i in (0, 1, 2)], dim=-1)) <= TOLERANCE


def test_routing_in_the_test_config_depends_on_groups_and_bias(tmp_path):
    """The parity tests would catch a router that ignored groups or the bias: both change the choice here."""
    save_reference(tmp_path, tiny_config())
    model = load_target(tmp_path)
    router = model.layers[1].mlp.gate
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    _, experts = router(x)
    scores = torch.nn.functional.linear(x, router.weight).sigmoid()
    ungrouped = (scores + router.e_score_correction_bias).topk(2).indices
    assert not torch.equal(experts.sort().values, ungrouped.sort().values)
    router.e_score_correction_bias.zero_()
    assert not torch.equal(router(x)[1], experts)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.booleans())
@settings(max_examples=30, deadline=None)
def test_grouped_matmul_multiplies_each_group_by_its_weight(group_sizes, one_kernel):
    """Both dispatches (``F.grouped_mm`` and the loop it falls back to), empty groups included."""
    g = torch.Generator().manual_seed(sum(group_sizes))
    x = torch.randn(sum(group_sizes), 8, generator=g)
    weights = torch.randn(len(group_sizes), 8, 12, generator=g)
    ends = torch.tensor(group_sizes).cumsum(0).to(torch.int32)
    expected = torch.cat([x[end - n : end] @ w for n, end, w in zip(group_sizes, ends.tolist(), weights)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "has_grouped_mm", lambda *_: one_kernel)
        torch.testing.assert_close(moe.grouped_matmul(x, weights, ends), expected)


def test_grouped_mm_is_used_off_the_cpu_where_its_kernel_runs():
    """The meta device checks operands as CUDA does: bfloat16, 16-byte aligned rows."""

    def operands(device, dtype, out_features=16):
        return torch.empty(6, 8, device=device, dtype=dtype), torch.empty(
            3, 8, out_features, device=device, dtype=dtype
        )

    assert moe.has_grouped_mm(*operands("meta", torch.bfloat16))
    assert not moe.has_grouped_mm(*operands("meta", torch.bfloat16, out_features=5))  # 10-byte rows
    assert not moe.has_grouped_mm(*operands("meta", torch.float32))
    assert not moe.has_grouped_mm(*operands("cpu", torch.bfloat16))  # the loop: reading counts is free here


@pytest.mark.parametrize("masked", [False, True])
def test_softmax_attention_is_sdpa_with_narrower_values(masked):
    """The CPU's MLA attention equals the sdpa call other devices make (values narrower than keys)."""
    g = torch.Generator().manual_seed(0)
    query, keys = torch.randn(2, 1, 12, 80, generator=g), torch.randn(2, 1, 9, 80, generator=g)
    values = keys[..., :64]
    mask = None
    if masked:  # causal over the last 4 keys for each of 3 queries folded with 4 heads
        visible = torch.arange(9) <= torch.arange(5, 8).repeat_interleave(4)[:, None]
        mask = torch.zeros(2, 1, 12, 9).masked_fill_(~visible, float("-inf"))
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys, values, mask, scale=0.3)
    torch.testing.assert_close(softmax_attention(query, keys, values, mask, scale=0.3), expected)


def test_published_rope_scaling_config_matches_transformers_yarn():
    """The published config.json spells YaRN as ``rope_scaling`` + ``rope_theta``; both spellings agree with HF."""
    published = {"rope_theta": 10000.0, "max_position_embeddings": 128, "rope_scaling": {**YARN, "type": "yarn"}}
    del published["rope_scaling"]["rope_type"], published["rope_scaling"]["rope_theta"]
    ours = RotaryEmbedding(model_config.RopeParameters.from_dict(published), 8, torch.float32)
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](tiny_config())
    assert torch.equal(ours.inv_freq, hf_inv_freq)
    assert ours.attention_factor == hf_attention_factor
    assert ours.softmax_scale_factor == pytest.approx((0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)


def test_bfloat16_load_tracks_float32(tmp_path):
    save_reference(tmp_path, tiny_config())
    tokens = ForwardBatch.from_rows([[3, 1, 4, 1, 5, 9]], [0], [0])
    full = load_target(tmp_path)
    half = load_target(tmp_path, dtype="bfloat16")
    assert half.embed_tokens.weight.dtype == torch.bfloat16
    assert half.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    ref = full.forward(tokens, full.new_cache(1, 8)).logits
    low = half.forward(tokens, half.new_cache(1, 8)).logits
    assert low.dtype == torch.float32 and max_diff(low, ref) < 0.05 * ref.abs().max().item()


def test_misshapen_tensor_error_names_key_and_shapes(tmp_path):
    save_reference(tmp_path, tiny_config())
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(128, 31)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"kv_b_proj.weight.*\(128, 31\).*\(128, 32\)"):
        load_target(tmp_path)


def test_unsupported_config_is_rejected():
    config = tiny_config().to_dict() | {"scoring_func": "softmax"}
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        model_config.DeepseekV3Config.from_dict(config)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        model_config.DeepseekV3Config.from_dict(
            {k: v for k, v in tiny_config().to_dict().items() if k != "kv_lora_rank"}
        )


def test_unused_checkpoint_tensors_are_reported(tmp_path):
    save_reference(tmp_path, tiny_config())
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.stray.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="stray"):
        load_target(tmp_path)
