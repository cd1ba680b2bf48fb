"""DeepSeek-V3 MTP / NextN draft: loads the layer after ``num_hidden_layers`` by its published key names
and proposes exactly what a plain cache-less reference forward of the same weights predicts,
including chained k > 1 proposals and a second round after a rollback."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from tandem.models import CheckpointError, DraftInput, ForwardBatch, load_draft, load_target
from tests.models.conftest import ForcedTokens
from tests.models.test_deepseek_v3 import save_reference, tiny_config

NUM_LAYERS = 3  # target layers; the MTP layer is model.layers.3


def mtp_tensors(seed: int = 1) -> tuple[dict[str, torch.Tensor], DeepseekV3ForCausalLM]:
    """MTP tensors ``model.layers.3.*`` (published names), and an HF model whose ``layers[3]`` is that layer."""
    config = tiny_config(num_hidden_layers=NUM_LAYERS + 1)
    torch.manual_seed(seed)
    donor = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        donor.model.layers[NUM_LAYERS].mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    prefix = f"model.layers.{NUM_LAYERS}."
    saved = _saved_state(donor)  # per-expert keys, as published
    tensors = {k: v for k, v in saved.items() if k.startswith(prefix)}
    hidden = config.hidden_size
    tensors |= {
        prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden),
        prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
        prefix + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
        prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
        prefix + "shared_head.head.weight": torch.randn(config.vocab_size, hidden),  # engines use the target's
        prefix + "embed_tokens.weight": saved["model.embed_tokens.weight"],
    }
    return tensors, donor


def _saved_state(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes (per-expert ``experts.{e}.gate_proj.weight`` keys)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return load_file(Path(tmp) / "model.safetensors")


def write_target_with_mtp(path: Path) -> tuple[DeepseekV3ForCausalLM, dict[str, torch.Tensor], DeepseekV3ForCausalLM]:
    reference = save_reference(path, tiny_config(num_hidden_layers=NUM_LAYERS))
    tensors, donor = mtp_tensors()
    weights = load_file(path / "model.safetensors") | tensors
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return reference, tensors, donor


def reference_proposals(
    reference: DeepseekV3ForCausalLM, tensors: dict, donor: DeepseekV3ForCausalLM, tokens: list[int], k: int
) -> tuple[list[int], torch.Tensor]:
    """Cache-less MTP: pairs (h_{p-1}, x_p) for p = 1..n-1, then k chained argmax steps feeding back g (pre-norm).

    Returns the k proposals and the first step's logits ``[n - 1, V]`` (one per pair).
    """
    prefix = f"model.layers.{NUM_LAYERS}."
    eps = reference.config.rms_norm_eps

    def rms(x, name):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), tensors[f"{prefix}{name}.weight"], eps)

    with torch.no_grad():
        hidden = reference.model(torch.tensor([tokens])).last_hidden_state[0]  # after the final norm
        embed = reference.model.embed_tokens
        inputs, pairs = list(tokens[1:]), list(hidden[:-1])
        layer = donor.model.layers[NUM_LAYERS]
        assert donor.config._attn_implementation == "sdpa"  # mask=None + several queries -> causal
        proposals, logits = [], []
        for _ in range(k):
            fused = torch.cat([rms(embed(torch.tensor(inputs)), "enorm"), rms(torch.stack(pairs), "hnorm")], -1)
            u = (fused @ tensors[prefix + "eh_proj.weight"].T)[None]
            positions = torch.arange(1, len(inputs) + 1)[None]
            g = layer(u, position_embeddings=donor.model.rotary_emb(u, positions), attention_mask=None)[0]
            logits.append(reference.lm_head(rms(g, "shared_head.norm")))
            proposals.append(int(logits[-1][-1].argmax()))
            inputs.append(proposals[-1])
            pairs.append(g[-1])
    return proposals, logits[0]


def pairs_input(rows: list[list[int]], starts: list[int], slots: list[int], hidden: list[torch.Tensor]) -> DraftInput:
    return DraftInput(batch=ForwardBatch.from_rows(rows, starts, slots), hidden=torch.cat(hidden), history=None)


def test_mtp_proposals_match_reference_over_two_rounds_with_rollback(tmp_path):
    reference, tensors, donor = write_target_with_mtp(tmp_path)
    target = load_target(tmp_path)  # skips model.layers.3.* without complaint
    draft = load_draft("mtp", target)
    assert draft.hidden_kind == "last"
    k = 3
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (7, 4)]
    slots = [1, 0]
    target_cache, draft_cache = target.new_cache(2, 32), draft.new_cache(2, 32)

    out = target.forward(ForwardBatch.from_rows(seqs, [0, 0], slots), target_cache, return_hidden=True)
    hidden = list(out.hidden.split([len(s) for s in seqs]))
    inp = pairs_input([s[1:] for s in seqs], [1, 1], slots, [h[:-1] for h in hidden])
    proposal = draft.propose(inp, draft_cache, k)
    assert proposal.tokens.shape == (2, k) and proposal.probs is None
    references = [reference_proposals(reference, tensors, donor, seq, k) for seq in seqs]
    for b, (tokens, _) in enumerate(references):
        assert proposal.tokens[b].tolist() == tokens, b
    # The logits behind the first proposal, at every pair, agree numerically too.
    logits = draft.logits(draft.step(inp.batch, inp.hidden, draft.new_cache(2, 32)))
    assert (logits - torch.cat([ref_logits for _, ref_logits in references])).abs().max() <= 1e-4

    # Round 2: row 0 commits two drafts and a bonus token, row 1 only a bonus token.
    new = [proposal.tokens[0, :2].tolist() + [11], [12]]
    starts = [len(s) for s in seqs]
    draft_cache.truncate(slots, starts)  # drop the speculative entries
    out = target.forward(ForwardBatch.from_rows(new, starts, slots), target_cache, return_hidden=True)
    new_hidden = out.hidden.split([len(n) for n in new])
    inp = pairs_input(new, starts, slots, [torch.cat([h[-1:], nh[:-1]]) for h, nh in zip(hidden, new_hidden)])
    proposal = draft.propose(inp, draft_cache, k)
    for b, (seq, n) in enumerate(zip(seqs, new)):
        assert proposal.tokens[b].tolist() == reference_proposals(reference, tensors, donor, seq + n, k)[0], b


def write_nextn(path: Path, target_dir: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A separate NextN checkpoint as SGLang exports it: the target's config, only ``model.layers.{L}.*``."""
    path.mkdir()
    config = json.loads((target_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"architectures": ["DeepseekV3ForCausalLMNextN"]}))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_separate_nextn_checkpoint_proposes_like_the_embedded_layer(tmp_path):
    _, tensors, _ = write_target_with_mtp(tmp_path / "target")
    nextn = write_nextn(tmp_path / "nextn", tmp_path / "target", tensors)
    target = load_target(tmp_path / "target")
    tokens = [5, 9, 200, 31, 77, 4]
    out = target.forward(ForwardBatch.from_rows([tokens], [0], [0]), target.new_cache(1, 16), return_hidden=True)
    proposals = []
    for draft in (load_draft("mtp", target), load_draft(nextn, target)):
        inp = pairs_input([tokens[1:]], [1], [0], [out.hidden[:-1]])
        proposals.append(draft.propose(inp, draft.new_cache(1, 16), 4).tokens)
    assert torch.equal(proposals[0], proposals[1])


def test_target_without_mtp_layer_is_reported(tmp_path):
    save_reference(tmp_path, tiny_config(num_hidden_layers=NUM_LAYERS))
    with pytest.raises(CheckpointError, match=r"no MTP layer \(model\.layers\.3\.eh_proj\.weight missing"):
        load_draft("mtp", load_target(tmp_path))


def test_nextn_checkpoint_for_another_target_is_rejected(tmp_path):
    _, tensors, _ = write_target_with_mtp(tmp_path / "target")
    nextn = write_nextn(tmp_path / "nextn", tmp_path / "target", tensors)
    save_reference(tmp_path / "other", tiny_config(num_hidden_layers=NUM_LAYERS, vocab_size=256))
    with pytest.raises(ValueError, match=r"vocab_size=512\) does not fit the target \(hidden_size=64, vocab_size=256"):
        load_draft(nextn, load_target(tmp_path / "other"))


def test_a_constraint_confines_each_proposal(tmp_path):
    write_target_with_mtp(tmp_path)
    target = load_target(tmp_path)
    draft = load_draft("mtp", target)
    constraint = ForcedTokens([[3, 400, 3], [511, 0, 9]], 512)
    seqs = torch.randint(512, (2, 6), generator=torch.Generator().manual_seed(4)).tolist()
    hidden = target.forward(
        ForwardBatch.from_rows(seqs, [0, 0], [0, 1]), target.new_cache(2, 16), return_hidden=True
    ).hidden.split([6, 6])
    inp = pairs_input([s[1:] for s in seqs], [1, 1], [0, 1], [h[:-1] for h in hidden])
    inp.constraint = constraint
    constraint.check(draft.propose(inp, draft.new_cache(2, 16), 3))
