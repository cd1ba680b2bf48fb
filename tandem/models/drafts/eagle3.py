"""EAGLE-3 draft: fuses three target layers' hidden states; works with any Target (Llama 3, DeepSeek-V3).

Architecture (Li et al., "EAGLE-3", 2025; e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``), for the
pair of the target's aux hidden states ``a_{p-1} [3 * Ht]`` and token ``x_p``:

    h   = fc(a_{p-1})                                      # [H]; later chained steps: the previous g
    x   = cat(input_layernorm(embed(x_p)), hidden_norm(h)) # [2H]: the attention input
    h'  = h + o_proj(attn(x))                              # the residual is h, not x
    g_p = h' + mlp(post_attention_layernorm(h'))           # pre-norm hidden: what chaining feeds back
    d   = argmax lm_head(norm(g_p))                        # draft vocab; target id = d + d2t[d]

The attention is Llama (MHA/GQA) even next to an MLA target (the Kimi-K2.5-style drafts). The
embedding is the target's. Aux capture points: ``eagle_aux_hidden_state_layer_ids`` (top level
or under ``eagle_config``) are read in the SGLang/SpecForge convention, id ``i`` = the OUTPUT of
target layer ``i`` = HF ``hidden_states`` index ``i + 1`` (so the published ``[1, 29, 57]`` of
the 61-layer Kimi drafts is the default ``(2, L // 2, L - 3)``); without ids the target keeps its
default. Loading the draft sets ``target.aux_layer_ids``.

Key layouts, one converter each (:data:`LAYER_PREFIXES`): the decoder layer under ``midlayer.``,
``layers.0.`` or ``model.layers.0.``; ``fc.weight [H, 3 * Ht]``, ``norm.weight``,
``lm_head.weight [draft_V, H]``, optional ``d2t [draft_V]`` int64 offsets and ``t2d [V]`` bool.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tandem.models.attention import RaggedLayout
from tandem.models.base import BlockTable, Draft, DraftInput, DraftProposal, ForwardBatch, KVCache, Target
from tandem.models.config import Eagle3Config
from tandem.models.drafts.chained import check_pair, propose_chained
from tandem.models.layers import Layer
from tandem.models.linear import Linear
from tandem.models.llama3 import Attention, kv_entry_shape
from tandem.models.loading import CheckpointError, WeightReader, checkpoint_tensors, load_param
from tandem.models.mlp import GatedMLP
from tandem.models.norm import RMSNorm
from tandem.models.rope import Rotary, Rotation

LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")  # checkpoint prefix of our ``midlayer.``


class MidLayer(Layer):
    """EAGLE-3's decoder layer: attention over ``cat(normed embedding, normed hidden)``. ``-> [T, H]``."""

    def __init__(self, config: Eagle3Config, **factory):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, **factory)
        self.hidden_norm = RMSNorm(hidden, eps, **factory)
        self.self_attn = Attention(config, input_size=2 * hidden, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **factory)
        self.mlp = GatedMLP(hidden, config.intermediate_size, bias=config.mlp_bias, **factory)

    def forward(self, embeds: Tensor, hidden: Tensor, rope: Rotation, layout: RaggedLayout, cache: Tensor):
        """``embeds, hidden: [T, H]`` -> the pre-norm hidden ``[T, H]``."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, rope, layout, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def aux_layer_ids(config: Eagle3Config, target: Target) -> tuple[int, ...] | None:
    """HF ``hidden_states`` indices of the config's ``eagle_aux_hidden_state_layer_ids`` (None if absent)."""
    ids = config.eagle_aux_hidden_state_layer_ids
    if ids is None:
        return None
    indices = tuple(int(i) + 1 for i in ids)
    if not all(1 <= i <= target.num_layers for i in indices):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)} outside the target's {target.num_layers} layers"
        )
    return indices


class Eagle3(nn.Module, Draft):
    """The EAGLE-3 draft (implements :class:`tandem.models.base.Draft`); reads the target's ``aux_hidden``."""

    hidden_kind = "aux"
    follows_constraint = True

    def __init__(self, config: Eagle3Config, target: Target, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        check_pair(config, target, "EAGLE-3")
        factory = {"dtype": dtype, "device": device}
        hidden = config.hidden_size
        target_hidden = config.target_hidden_size or target.hidden_size
        self.draft_vocab_size = config.draft_vocab_size or target.vocab_size
        self.target_vocab_size = target.vocab_size
        # Bound method, not the module: the target must not become a submodule of the draft.
        self.target_embed = target.embed
        self.dtype = dtype
        self.fc = Linear(len(target.aux_layer_ids) * target_hidden, hidden, bias=False, **factory)
        self.midlayer = MidLayer(config, **factory)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, **factory)
        self.lm_head = Linear(hidden, self.draft_vocab_size, bias=False, **factory)
        # draft id d -> target id d + d2t[d]: [draft_V] int64, set by `build` from the checkpoint's d2t
        self.target_ids = nn.Buffer(torch.arange(self.draft_vocab_size, device=device), persistent=False)
        self.maps_ids = self.draft_vocab_size != self.target_vocab_size  # False: draft ids are target ids
        self.rotary = Rotary(config.rope, config.head_dim, dtype)

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> KVCache:
        """One pool ``[num_blocks, block_size, 2, nkv, head_dim]`` over ``table``, first position 1."""
        entry = kv_entry_shape(self.midlayer.self_attn)
        device = self.fc.weight.device
        return KVCache.allocate(
            1, num_slots, max_len, entry, dtype=self.dtype, device=device, first_position=1, table=table
        )

    def step(self, batch: ForwardBatch, hidden: Tensor, cache: KVCache) -> Tensor:
        """``hidden [T, H]`` (``fc`` output or the previous pre-norm output) -> pre-norm hidden ``[T, H]``."""
        cache.begin_forward(batch.spans)
        layout = RaggedLayout.build(batch, cache)
        return self.step_layout(layout, batch.input_ids, batch.positions, hidden, cache.layers)

    def step_layout(
        self, layout: RaggedLayout, input_ids: Tensor, positions: Tensor, hidden: Tensor, layers: list[Tensor]
    ) -> Tensor:
        """:meth:`step`'s tensor body over a planned ``layout`` (``input_ids, positions [T]``); compiles whole."""
        rope = self.rotary(positions, layout.max_key)
        return self.midlayer(self.target_embed(input_ids), hidden, rope, layout, layers[0])

    def logits(self, hidden: Tensor) -> Tensor:
        """``hidden [N, H]`` pre-norm output -> draft-vocabulary logits ``[N, draft_V]``."""
        return self.lm_head(self.norm(hidden))

    def target_logits(self, hidden: Tensor) -> Tensor:
        """``hidden [B, H]`` -> ``[B, V_target]``: each draft id's logit at its target id, -inf elsewhere."""
        logits = self.logits(hidden)
        if not self.maps_ids:
            return logits
        full = logits.new_full((len(logits), self.target_vocab_size), float("-inf"))
        return full.index_copy_(1, self.target_ids, logits)

    def propose(self, inp: DraftInput, cache: KVCache, num_tokens: int) -> DraftProposal:
        """Greedy EAGLE-3 proposals ``tokens [B, num_tokens]``; ``probs`` None (deterministic)."""
        if inp.hidden is None or inp.hidden.shape[-1] != self.fc.in_features:
            shape = None if inp.hidden is None else tuple(inp.hidden.shape)
            raise ValueError(f"EAGLE-3 needs the target's aux_hidden [T, {self.fc.in_features}], got {shape}")
        fused = self.fc(inp.hidden.to(self.dtype))
        tokens = propose_chained(inp.step or self.step, self.target_logits, inp, fused, cache, num_tokens)
        return DraftProposal(tokens=tokens, probs=None)


def layer_prefix(weights: WeightReader) -> str:
    """The checkpoint prefix of the decoder layer: one of :data:`LAYER_PREFIXES`."""
    for prefix in LAYER_PREFIXES:
        if f"{prefix}self_attn.q_proj.weight" in weights:
            return prefix
    raise CheckpointError(f"{weights.path}: no EAGLE-3 decoder layer under any of {list(LAYER_PREFIXES)}")


@torch.no_grad()
def build(
    config: Eagle3Config, weights: WeightReader, *, dtype: torch.dtype, device: torch.device, target: Target
) -> Eagle3:
    """The loading registry's builder for EAGLE-3 checkpoints; sets ``target.aux_layer_ids``."""
    if config.vocab_size is not None and config.vocab_size != target.vocab_size:
        raise ValueError(f"EAGLE-3 draft vocab_size {config.vocab_size} != the target's {target.vocab_size}")
    ids = aux_layer_ids(config, target)
    if ids is not None:
        target.aux_layer_ids = ids
    draft = Eagle3(config, target, dtype=dtype, device="meta").to_empty(device=device)  # weights follow
    prefix = layer_prefix(weights)
    for name, param, part in checkpoint_tensors(draft):
        key = prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        load_param(param, weights.take, key, part)
    mapped = torch.arange(draft.draft_vocab_size, device=device)
    if "d2t" in weights:
        mapped += weights.take("d2t", (draft.draft_vocab_size,), dtype=torch.int64).to(device)
    elif draft.draft_vocab_size != target.vocab_size:
        raise CheckpointError(f"{weights.path}: draft_vocab_size {draft.draft_vocab_size} < target vocab but no 'd2t'")
    if (mapped < 0).any() or (mapped >= target.vocab_size).any():
        raise CheckpointError(f"{weights.path}: d2t maps draft ids outside the target vocab [0, {target.vocab_size})")
    draft.target_ids.copy_(mapped)
    draft.maps_ids = not torch.equal(mapped, torch.arange(target.vocab_size, device=device))
    if "t2d" in weights:
        weights.take("t2d", (target.vocab_size,), dtype=torch.bool)  # shape-checked; d2t alone maps ids
    weights.finish(ignore=[r"(model\.)?embed_tokens\.weight$"])
    return draft.eval().requires_grad_(False)
