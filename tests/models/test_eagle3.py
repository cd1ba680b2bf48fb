"""EAGLE-3 draft: published key layouts, d2t mapping, aux-layer ids; cached propose() == plain forward."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import save_file

from tandem.models import CheckpointError, DraftInput, ForwardBatch, load_draft, load_target
from tandem.models.drafts.eagle3 import Eagle3
from tests.models.conftest import FavouredTokens, ForcedTokens

HEADS, KV_HEADS, THETA, DRAFT_VOCAB = 4, 2, 10000.0, 128  # no rope_theta in the config: 10000


def write_eagle3(
    path,
    *,
    prefix="midlayer.",
    hidden=64,
    inter=96,
    vocab=512,
    draft_vocab=DRAFT_VOCAB,
    aux_ids=(0, 1, 2),
    arch="LlamaForCausalLMEagle3",
    seed=0,
):
    """A synthetic EAGLE-3 checkpoint with the published key names/shapes; returns its tensors."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    head_dim = hidden // HEADS
    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values  # the draft vocabulary
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    w = {
        "fc.weight": rand(hidden, 3 * hidden),
        f"{prefix}input_layernorm.weight": 1 + rand(hidden),
        f"{prefix}hidden_norm.weight": 1 + rand(hidden),
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * head_dim, 2 * hidden),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * head_dim, 2 * hidden),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * head_dim, 2 * hidden),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, HEADS * head_dim),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(hidden),
        f"{prefix}mlp.gate_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.up_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(draft_vocab, hidden, scale=1.0),
        "d2t": kept - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {
        "architectures": [arch], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)},
    }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(w, path / "model.safetensors")
    return {(k.replace(prefix, "midlayer.") if k.startswith(prefix) else k): v for k, v in w.items()}


def reference_outputs(ref, w, target, fused, tokens):
    """EAGLE-3's uncached layer: ``fused [n, H]`` hidden (fc output or fed back), ``tokens [n]`` -> ``[n, H]``."""
    x = torch.cat(
        [
            ref.rms(target.embed(tokens), w["midlayer.input_layernorm.weight"]),
            ref.rms(fused, w["midlayer.hidden_norm.weight"]),
        ],
        -1,
    )
    positions = torch.arange(1, len(tokens) + 1)
    h = fused + ref.attention(x, w, "midlayer.self_attn.", positions, HEADS, KV_HEADS, THETA)
    return h + ref.mlp(ref.rms(h, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer.mlp.")


def reference_propose(ref, w, target, aux, tokens, k):
    """Greedy chain from scratch: fc(aux) for committed pairs, then the pre-norm output fed back."""
    fused, out = aux @ w["fc.weight"].T, []
    for _ in range(k):
        g = reference_outputs(ref, w, target, fused, tokens)[-1]
        draft_id = int((ref.rms(g, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        out.append(draft_id + int(w["d2t"][draft_id]))
        fused, tokens = torch.cat([fused, g[None]]), torch.cat([tokens, torch.tensor(out[-1:])])
    return out


def check_against_reference(draft, target, w, reference, vocab):
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(vocab, (n,), generator=g) for n in (8, 5)]
    tcache, dcache = target.new_cache(2, 32), draft.new_cache(2, 32)
    aux = target.forward(
        ForwardBatch.from_rows([s.tolist() for s in seqs], [0, 0], [0, 1]), tcache, return_aux=True
    ).aux_hidden
    auxes = [aux[:8], aux[8:]]
    batch = ForwardBatch.from_rows([s[1:].tolist() for s in seqs], [1, 1], [0, 1])
    proposal = draft.propose(
        DraftInput(batch=batch, hidden=torch.cat([a[:-1] for a in auxes]), history=None), dcache, 4
    )
    assert proposal.probs is None and proposal.tokens.shape == (2, 4)
    for b in range(2):
        assert proposal.tokens[b].tolist() == reference_propose(reference, w, target, auxes[b][:-1], seqs[b][1:], 4)
    # A rollback: keep one draft, then the bonus; the stale speculative entries are overwritten.
    dcache.truncate([0, 1], [8, 5])
    new_tokens = [proposal.tokens[0, :1].tolist() + [5], [9]]
    verify = ForwardBatch.from_rows([[int(seqs[0][-1]), new_tokens[0][0]], [int(seqs[1][-1])]], [7, 4], [0, 1])
    new_aux = target.forward(verify, tcache, return_aux=True).aux_hidden
    proposal = draft.propose(DraftInput(ForwardBatch.from_rows(new_tokens, [8, 5], [0, 1]), new_aux, None), dcache, 3)
    for b, a_new in enumerate((new_aux[:2], new_aux[2:])):
        expected = reference_propose(
            reference,
            w,
            target,
            torch.cat([auxes[b][:-1], a_new]),
            torch.cat([seqs[b][1:], torch.tensor(new_tokens[b])]),
            3,
        )
        assert proposal.tokens[b].tolist() == expected
    kept = w["d2t"] + torch.arange(len(w["d2t"]))
    assert torch.isin(proposal.tokens, kept).all()  # every proposal is a mapped draft-vocab id


@pytest.fixture
def target(llama_dir):
    return load_target(llama_dir)


@pytest.mark.parametrize("prefix", ["midlayer.", "layers.0.", "model.layers.0."])
def test_llama_target_propose_matches_reference_for_each_layout(tmp_path, target, reference, prefix):
    w = write_eagle3(tmp_path, prefix=prefix)
    draft = load_draft(tmp_path, target)
    assert isinstance(draft, Eagle3) and draft.hidden_kind == "aux"
    assert target.aux_layer_ids == (1, 2, 3)  # ids name layer outputs: HF hidden_states index + 1
    check_against_reference(draft, target, w, reference, 512)


@pytest.mark.parametrize("permuted", [False, True])
def test_a_full_size_draft_vocab_maps_ids_only_where_d2t_moves_them(tmp_path, target, reference, permuted):
    """Draft ids are target ids unless d2t moves them: then each logit lands at its mapped id."""
    w = write_eagle3(tmp_path, draft_vocab=512)
    if permuted:
        w["d2t"] = torch.randperm(512, generator=torch.Generator().manual_seed(1)) - torch.arange(512)
        save_file(w, tmp_path / "model.safetensors")
    draft = load_draft(tmp_path, target)
    assert draft.maps_ids == permuted
    check_against_reference(draft, target, w, reference, 512)


def test_fc_width_is_detected_without_an_eagle3_architecture_name(tmp_path, target):
    write_eagle3(tmp_path, arch="LlamaForCausalLM")
    assert isinstance(load_draft(tmp_path, target), Eagle3)


def test_bad_pairs_and_d2t_fail_clearly(tmp_path, target):
    w = write_eagle3(tmp_path / "a", aux_ids=(0, 1, 7))
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[0, 1, 7\] outside the target's 4"):
        load_draft(tmp_path / "a", target)
    w = write_eagle3(tmp_path / "b")
    w["d2t"] = w["d2t"] + 1000
    save_file(w, tmp_path / "b" / "model.safetensors")  # the default layout: keys as returned
    with pytest.raises(CheckpointError, match=r"d2t maps draft ids outside the target vocab \[0, 512\)"):
        load_draft(tmp_path / "b", target)
    w = write_eagle3(tmp_path / "c")
    del w["d2t"]
    save_file(w, tmp_path / "c" / "model.safetensors")
    with pytest.raises(CheckpointError, match="draft_vocab_size 128 < target vocab but no 'd2t'"):
        load_draft(tmp_path / "c", target)


def test_deepseek_v3_target_with_an_mha_eagle3_draft(tmp_path, reference):
    """Kimi-K2.5 style: a Llama-layer EAGLE-3 draft next to an MLA + MoE target."""
    if not hasattr(importlib.import_module("tandem.models.deepseek_v3"), "build"):
        pytest.skip("tandem.models.deepseek_v3 has no builder yet")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32,
        q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    DeepseekV3ForCausalLM(config).eval().save_pretrained(tmp_path / "target")
    target = load_target(tmp_path / "target")
    w = write_eagle3(tmp_path / "draft", prefix="layers.0.", aux_ids=(1, 2, 4), arch="Eagle3DeepseekV2ForCausalLM")
    draft = load_draft(tmp_path / "draft", target)
    assert target.aux_layer_ids == (2, 3, 5)
    check_against_reference(draft, target, w, reference, 512)


def test_a_constraint_confines_each_proposal_to_allowed_draft_vocab_ids(tmp_path, target):
    w = write_eagle3(tmp_path)
    draft = load_draft(tmp_path, target)
    kept = (w["d2t"] + torch.arange(DRAFT_VOCAB)).tolist()  # the target ids the draft can propose
    constraint = ForcedTokens([[kept[5], kept[17], kept[3]], [kept[1], kept[90], kept[0]]], 512)
    tokens = torch.randint(512, (2, 6), generator=torch.Generator().manual_seed(4))
    aux = target.forward(
        ForwardBatch.from_rows(tokens.tolist(), [0, 0], [0, 1]), target.new_cache(2, 16), return_aux=True
    ).aux_hidden
    batch = ForwardBatch.from_rows(tokens[:, 1:].tolist(), [1, 1], [0, 1])
    hidden = torch.cat([aux[:5], aux[6:11]])
    constraint.check(draft.propose(DraftInput(batch, hidden, None, constraint), draft.new_cache(2, 16), 3))


def test_adjusted_logits_steer_each_proposal_within_the_draft_vocab(tmp_path, target):
    """Penalties and biases apply over the target vocabulary; ids the draft vocabulary lacks stay unproposable."""
    w = write_eagle3(tmp_path)
    draft = load_draft(tmp_path, target)
    kept = (w["d2t"] + torch.arange(DRAFT_VOCAB)).tolist()
    missing = next(t for t in range(512) if t not in kept)
    tokens = torch.randint(512, (2, 6), generator=torch.Generator().manual_seed(4))
    aux = target.forward(
        ForwardBatch.from_rows(tokens.tolist(), [0, 0], [0, 1]), target.new_cache(2, 16), return_aux=True
    ).aux_hidden
    batch = ForwardBatch.from_rows(tokens[:, 1:].tolist(), [1, 1], [0, 1])
    hidden = torch.cat([aux[:5], aux[6:11]])
    favoured = FavouredTokens([[kept[5], kept[17], kept[3]], [kept[1], kept[90], kept[0]]])
    favoured.check(draft.propose(DraftInput(batch, hidden, None, adjust=favoured), draft.new_cache(2, 16), 3))
    unreachable = FavouredTokens([[missing] * 3, [missing] * 3])
    proposal = draft.propose(DraftInput(batch, hidden, None, adjust=unreachable), draft.new_cache(2, 16), 3)
    assert missing not in proposal.tokens.flatten().tolist()
