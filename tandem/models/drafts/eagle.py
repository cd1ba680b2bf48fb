"""EAGLE (v1/v2) draft for Llama 3 targets, and the chaining loop EAGLE-3 shares.

Architecture (Li et al., "EAGLE", 2024; published checkpoints such as
``yuhuili/EAGLE-LLaMA3-Instruct-8B``), for the pair of target feature ``f_{p-1}`` (the
target's last hidden state AFTER its final norm) and token ``x_p``:

    g_p     = layer(fc(cat(embed(x_p), f_{p-1})))      # one Llama layer without input_layernorm
    x_{p+1} = argmax lm_head(g_p)                       # the target's embedding and head, no norm

Chaining k > 1 feeds the draft's own output ``g_p`` back in place of ``f_p``. Keys:
``fc.weight [H, 2H]`` (+ ``fc.bias`` unless the config says ``"bias": false``), ``layers.0.*``
(no ``input_layernorm``); an ``embed_tokens.weight`` copy of the target's is ignored.
The draft's KV cache keeps the pair ``(f_{p-1}, x_p)`` at position ``p`` (first position 1).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tandem.models.attention import RaggedLayout
from tandem.models.base import BlockTable, Draft, DraftInput, DraftProposal, ForwardBatch, KVCache, Target
from tandem.models.config import EagleConfig
from tandem.models.drafts.chained import check_pair, propose_chained
from tandem.models.linear import Linear
from tandem.models.llama3 import DecoderLayer, kv_entry_shape
from tandem.models.loading import WeightReader, load_module
from tandem.models.rope import Rotary


class Eagle(nn.Module, Draft):
    """The EAGLE-1/2 draft (implements :class:`tandem.models.base.Draft`); reads the target's ``hidden``."""

    hidden_kind = "last"
    follows_constraint = True

    def __init__(self, config: EagleConfig, target: Target, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        check_pair(config, target, "EAGLE")
        factory = {"dtype": dtype, "device": device}
        hidden = config.hidden_size
        # Bound methods, not the module: the target must not become a submodule of the draft.
        self.target_embed, self.target_lm_head = target.embed, target.lm_head
        self.dtype = dtype
        self.fc = Linear(2 * hidden, hidden, bias=config.bias, **factory)
        self.layers = nn.ModuleList([DecoderLayer(config, input_layernorm=False, **factory)])
        self.rotary = Rotary(config.rope, config.head_dim, dtype)

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> KVCache:
        """One pool ``[num_blocks, block_size, 2, nkv, head_dim]`` over ``table``, first position 1."""
        entry = kv_entry_shape(self.layers[0].self_attn)
        device = self.fc.weight.device
        return KVCache.allocate(
            1, num_slots, max_len, entry, dtype=self.dtype, device=device, first_position=1, table=table
        )

    def step(self, batch: ForwardBatch, features: Tensor, cache: KVCache) -> Tensor:
        """``features [T, H]`` (target hidden or the draft's own output) -> draft output ``[T, H]``."""
        cache.begin_forward(batch.spans)
        layout = RaggedLayout.build(batch, cache)
        return self.step_layout(layout, batch.input_ids, batch.positions, features, cache.layers)

    def step_layout(
        self, layout: RaggedLayout, input_ids: Tensor, positions: Tensor, features: Tensor, layers: list[Tensor]
    ) -> Tensor:
        """:meth:`step`'s tensor body over a planned ``layout`` (``input_ids, positions [T]``); compiles whole."""
        x = self.fc(torch.cat([self.target_embed(input_ids), features.to(self.dtype)], dim=-1))
        return self.layers[0](x, self.rotary(positions, layout.max_key), layout, layers[0])

    def logits(self, hidden: Tensor) -> Tensor:
        """``hidden [N, H]`` draft output -> ``[N, V] float32``: the target's head, no norm."""
        return self.target_lm_head(hidden)

    target_logits = logits  # what a proposal takes its argmax of (graph mode's chain reads it by this name)

    def propose(self, inp: DraftInput, cache: KVCache, num_tokens: int) -> DraftProposal:
        """Greedy EAGLE proposals ``tokens [B, num_tokens]``; ``probs`` None (deterministic)."""
        if inp.hidden is None:
            raise ValueError("the EAGLE draft needs DraftInput.hidden: the target's last hidden state [T, H]")
        tokens = propose_chained(inp.step or self.step, self.target_logits, inp, inp.hidden, cache, num_tokens)
        return DraftProposal(tokens=tokens, probs=None)


def build(
    config: EagleConfig, weights: WeightReader, *, dtype: torch.dtype, device: torch.device, target: Target
) -> Eagle:
    """The loading registry's builder for EAGLE-1/2 checkpoints (``fc.*``, ``layers.0.*``)."""
    draft = Eagle(config, target, dtype=dtype, device="meta").to_empty(device=device)  # weights follow
    load_module(draft, weights.take, "")
    weights.finish(ignore=[r"embed_tokens\.weight$", r"model\.embed_tokens\.weight$"])
    return draft.eval().requires_grad_(False)
