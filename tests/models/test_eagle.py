"""EAGLE-1/2 draft for Llama 3: loads the published layout; cached propose() == a plain uncached forward."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tandem.models import CheckpointError, DraftInput, ForwardBatch, load_draft, load_target
from tandem.models.drafts.eagle import Eagle
from tests.models.conftest import ForcedTokens

HEADS, KV_HEADS, THETA = 4, 2, 10000.0


def write_eagle(path, hidden=64, inter=96, vocab=512, seed=0, bias=False):
    """A synthetic EAGLE-LLaMA3 checkpoint with the published key names and shapes."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    head_dim = hidden // HEADS
    w = {
        "fc.weight": rand(hidden, 2 * hidden),
        "embed_tokens.weight": rand(vocab, hidden),  # published drafts carry a copy; unused
        "layers.0.self_attn.q_proj.weight": rand(HEADS * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": rand(KV_HEADS * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": rand(KV_HEADS * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, HEADS * head_dim),
        "layers.0.post_attention_layernorm.weight": 1 + rand(hidden),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
        "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, inter),
    }
    if bias:
        w["fc.bias"] = rand(hidden)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": vocab, "rope_theta": THETA, "rms_norm_eps": 1e-6,
        "bias": bias, "hidden_act": "silu",
    }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(w, path / "model.safetensors")
    return w


def reference_outputs(ref, w, target, features, tokens):
    """EAGLE's uncached forward: ``features [n, H]`` (f_0..), ``tokens [n]`` (x_1..) -> draft outputs ``[n, H]``."""
    x = torch.cat([target.embed(tokens), features], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
    positions = torch.arange(1, len(tokens) + 1)
    x = x + ref.attention(x, w, "layers.0.self_attn.", positions, HEADS, KV_HEADS, THETA)
    return x + ref.mlp(ref.rms(x, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.mlp.")


def reference_propose(ref, w, target, features, tokens, k):
    """Greedy chain: each step re-runs the whole sequence from scratch, feeding back the draft output."""
    out = []
    for _ in range(k):
        g = reference_outputs(ref, w, target, features, tokens)[-1]
        out.append(int(target.lm_head(g[None]).argmax()))
        features, tokens = torch.cat([features, g[None]]), torch.cat([tokens, torch.tensor(out[-1:])])
    return out


@pytest.fixture(scope="module")
def target(llama_dir):
    return load_target(llama_dir)


@pytest.mark.parametrize("bias", [False, True])
def test_propose_matches_the_uncached_reference_across_rollbacks(tmp_path, target, reference, bias):
    w = write_eagle(tmp_path, bias=bias)
    draft = load_draft(tmp_path, target)
    assert isinstance(draft, Eagle) and draft.hidden_kind == "last"
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(512, (n,), generator=g) for n in (9, 5)]
    tcache, dcache = target.new_cache(2, 32), draft.new_cache(2, 32)
    hidden = target.forward(
        ForwardBatch.from_rows([s.tolist() for s in seqs], [0, 0], [1, 0]), tcache, return_hidden=True
    ).hidden
    feats = [hidden[:9], hidden[9:]]
    # Round 1: committed x_1..x_{n-1} paired with h_0..h_{n-2}; round 2 after a rollback: the engine
    # truncates to the first new position and sends the newly committed tokens with the target's hidden.
    batch = ForwardBatch.from_rows([s[1:].tolist() for s in seqs], [1, 1], [1, 0])
    inp = DraftInput(batch=batch, hidden=torch.cat([f[:-1] for f in feats]), history=None)
    proposal = draft.propose(inp, dcache, 4)
    assert proposal.probs is None and proposal.tokens.shape == (2, 4)
    for b in range(2):
        expected = reference_propose(reference, w, target, feats[b][:-1], seqs[b][1:], 4)
        assert proposal.tokens[b].tolist() == expected

    extra = [proposal.tokens[0, :2].tolist() + [7], [11]]  # row 0 accepted 2 drafts + bonus, row 1 none + bonus
    verify = ForwardBatch.from_rows([[int(seqs[0][-1])] + extra[0][:2], [int(seqs[1][-1])]], [8, 4], [1, 0])
    new_hidden = target.forward(verify, tcache, return_hidden=True).hidden
    starts = [len(seqs[0]), len(seqs[1])]
    dcache.truncate([1, 0], starts)
    batch = ForwardBatch.from_rows(extra, starts, [1, 0])
    proposal = draft.propose(DraftInput(batch=batch, hidden=new_hidden, history=None), dcache, 3)
    for b, h_new in enumerate([new_hidden[:3], new_hidden[3:]]):
        features = torch.cat([feats[b][:-1], h_new])
        tokens = torch.cat([seqs[b][1:], torch.tensor(extra[b])])
        expected = reference_propose(reference, w, target, features, tokens, 3)
        assert proposal.tokens[b].tolist() == expected


def test_draft_outputs_match_the_reference_numerically(tmp_path, target, reference):
    w = write_eagle(tmp_path)
    draft = load_draft(tmp_path, target)
    tokens, feats = torch.randint(512, (6,)), torch.randn(6, 64)
    batch = ForwardBatch.from_rows([tokens.tolist()], [1], [0])
    out = draft.step(batch, feats, draft.new_cache(1, 16))
    assert (out - reference_outputs(reference, w, target, feats, tokens)).abs().max() <= 1e-4


def test_mismatched_pairs_and_shapes_fail_with_names(tmp_path, target):
    write_eagle(tmp_path / "wide", hidden=128)
    with pytest.raises(ValueError, match="EAGLE draft hidden_size 128 does not match the target's 64"):
        load_draft(tmp_path / "wide", target)
    w = write_eagle(tmp_path / "bad")
    w["layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(w, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"'layers\.0\.mlp\.up_proj\.weight' has shape \(95, 64\), expected \(96, 64\)"
    ):
        load_draft(tmp_path / "bad", target)


def test_a_constraint_confines_each_proposal(tmp_path, target):
    write_eagle(tmp_path)
    draft = load_draft(tmp_path, target)
    constraint = ForcedTokens([[3, 400, 3, 7], [511, 0, 9, 9]], 512)
    tokens = torch.randint(512, (2, 6), generator=torch.Generator().manual_seed(4))
    hidden = target.forward(
        ForwardBatch.from_rows(tokens.tolist(), [0, 0], [0, 1]), target.new_cache(2, 16), return_hidden=True
    ).hidden
    batch = ForwardBatch.from_rows(tokens[:, 1:].tolist(), [1, 1], [0, 1])
    inp = DraftInput(batch, torch.cat([hidden[:5], hidden[6:11]]), None, constraint)
    constraint.check(draft.propose(inp, draft.new_cache(2, 16), 4))
