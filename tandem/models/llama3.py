"""Llama 3 target: GQA attention over a paged KV cache, RoPE with ``llama3`` frequency scaling.

Module names mirror the published checkpoints (``model.layers.{i}.self_attn.o_proj.weight``,
``lm_head.weight``, ...) except the merged projections, which name their parts' keys
(:func:`tandem.models.loading.checkpoint_tensors`), so loading is one pass over the module.
:class:`Attention` and :class:`DecoderLayer` are shared with the EAGLE and EAGLE-3 drafts. Each op
has one path; the fast paths sit behind the building blocks (:mod:`~tandem.models.linear`,
:mod:`~tandem.models.norm`, :mod:`~tandem.models.rope`), the ragged batch's layout and cache
addressing behind :class:`tandem.models.attention.RaggedLayout`. The settings are a
:class:`~tandem.models.config.LlamaConfig`. The cache entry per token and layer is the stacked
``(K, V)``: ``[2, num_key_value_heads, head_dim]``.

Tensor parallel (a parallel :class:`~tandem.models.parallel.Shard`, vLLM's Megatron layout): each rank keeps
``1 / size`` of the query and of the key/value heads (QKV column-parallel, ``o_proj`` row-parallel), of the MLP
columns, and of the vocabulary (:mod:`tandem.models.vocab`); two all-reduces per layer, one for the embedding
and an all-gather of the logits, so every rank's forward returns what one device would. Its cache holds its
key/value heads only. Every rank runs the same forward on the same batch (SPMD); the drafts run on rank 0 and
call ``embed`` / ``lm_head``, the whole-vocabulary ops rank 0 keeps.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from tandem.models.attention import RaggedLayout
from tandem.models.base import BlockTable, ForwardBatch, KVCache, TargetOutput, default_aux_layer_ids
from tandem.models.config import LlamaConfig
from tandem.models.layers import Layer
from tandem.models.linear import MergedLinear, RowParallelLinear
from tandem.models.loading import WeightReader, load_module
from tandem.models.mlp import GatedMLP
from tandem.models.norm import RMSNorm
from tandem.models.parallel import SINGLE, Shard
from tandem.models.rope import Rotary, Rotation
from tandem.models.vocab import ParallelLMHead, VocabParallelEmbedding


class Attention(Layer):
    """GQA self-attention writing into and reading from a paged cache. ``x: [T, input_size] -> [T, H]``.

    ``input_size`` is the hidden size except in EAGLE-3's draft layer (2 * hidden). The q/k/v
    projections are one :class:`MergedLinear` (checkpoint keys ``q_proj``, ``k_proj``, ``v_proj``).
    With a parallel ``shard``, this rank's heads: ``num_heads`` and ``num_kv_heads`` are the local counts,
    ``o_proj`` is row-parallel (ValueError naming the heads where the size does not divide them).
    """

    def __init__(self, config: LlamaConfig, input_size: int | None = None, *, shard: Shard = SINGLE, **factory):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads = shard.part(config.num_attention_heads, "num_attention_heads")[1]
        self.num_kv_heads = shard.part(config.num_key_value_heads, "num_key_value_heads")[1]
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        parts = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(input_size or hidden, parts, bias=bias, shard=shard, **factory)
        self.o_proj = RowParallelLinear(q_size, hidden, bias=bias, shard=shard, **factory)

    def forward(self, x: Tensor, rope: Rotation, layout: RaggedLayout, cache: Tensor) -> Tensor:
        """Write the batch's K/V into ``cache [num_blocks, block_size, 2, nkv, d]`` at the tokens' positions, then
        attend (``rope``: what :class:`Rotary` returned for those positions)."""
        rotated_heads = self.num_heads + self.num_kv_heads
        num_tokens = x.shape[0]  # not len(x): Tensor.__len__ is a Python-level method, slower than the shape
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, nh + 2 nkv, d]
        q, k = rope.apply(qkv[:, :rotated_heads]).split([self.num_heads, self.num_kv_heads], dim=1)
        kv = torch.cat([k, qkv[:, rotated_heads:]], dim=1).view(num_tokens, 2, self.num_kv_heads, self.head_dim)
        layout.addressing.write(cache, kv)
        out = layout.attend(q, cache, self.head_dim**-0.5)
        return self.o_proj(out.flatten(1))


class DecoderLayer(Layer):
    """Pre-norm Llama block ``x: [T, H] -> [T, H]``. EAGLE-1's draft layer has no ``input_layernorm``."""

    def __init__(self, config: LlamaConfig, *, input_layernorm: bool = True, shard: Shard = SINGLE, **factory):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, **factory) if input_layernorm else nn.Identity()
        self.self_attn = Attention(config, shard=shard, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **factory)
        self.mlp = GatedMLP(hidden, config.intermediate_size, bias=config.mlp_bias, shard=shard, **factory)

    def forward(self, x: Tensor, rope: Rotation, layout: RaggedLayout, cache: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layout, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def kv_entry_shape(attention: Attention) -> tuple[int, ...]:
    """One token's cache entry for ``attention``: ``(2, num_kv_heads, head_dim)`` (its rank's heads)."""
    return (2, attention.num_kv_heads, attention.head_dim)


class _Body(nn.Module):
    """``model.*``: embeddings, decoder layers, final norm."""

    def __init__(self, config: LlamaConfig, shard: Shard, **factory):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, shard=shard, tied=config.tie_word_embeddings, **factory
        )
        layers = (DecoderLayer(config, shard=shard, **factory) for _ in range(config.num_hidden_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


def check_shard(config: LlamaConfig, shard: Shard) -> None:
    """Refuse, with a ValueError naming the numbers, a layout tandem does not run Llama 3 in: a data-parallel
    attention or expert-parallel shard, or sizes the ranks do not divide (heads, KV heads, ``intermediate_size``,
    ``vocab_size``). Reads only the config: a launcher calls it before it starts a process or reads a weight."""
    if shard.data_parallel_attention or shard.expert_parallel:
        raise ValueError("Llama 3 splits over ranks by tensor parallelism only (no data-parallel attention or experts)")
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        shard.part(getattr(config, what), what)


class Llama3(nn.Module):
    """The Llama 3 target (implements :class:`tandem.models.base.Target`); with a parallel ``shard``, this rank's
    part of it. Construction runs no collective (a ``"meta"`` model counts a rank's bytes without a group)."""

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype, device: torch.device | str, shard: Shard = SINGLE):
        super().__init__()
        check_shard(config, shard)
        self.config, self.shard = config, shard
        self.checkpoint_dir: Path | None = None
        self.vocab_size, self.hidden_size, self.dtype = config.vocab_size, config.hidden_size, dtype
        self.num_layers = config.num_hidden_layers
        self.aux_layer_ids = default_aux_layer_ids(self.num_layers)
        factory = {"dtype": dtype, "device": device}
        self.model = _Body(config, shard, **factory)
        self.tied = config.tie_word_embeddings
        self.lm_head_proj = (
            None if self.tied else ParallelLMHead(self.vocab_size, self.hidden_size, shard=shard, **factory)
        )
        self.rotary = Rotary(config.rope, config.head_dim, dtype)

    # Checkpoint key of the head is ``lm_head.weight``; ``lm_head`` itself is the Target method.
    def load(self, weights: WeightReader) -> None:
        load_module(self.model, weights.take, "model.")
        if not self.tied:
            load_module(self.lm_head_proj, weights.take, "lm_head.")
        weights.finish(ignore=[r"lm_head\.weight$"] if self.tied else [])

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> KVCache:
        """``num_layers`` pools ``[num_blocks, block_size, 2, num_key_value_heads, head_dim]`` over ``table``."""
        entry = kv_entry_shape(self.model.layers[0].self_attn)
        device = self.model.embed_tokens.weight.device
        return KVCache.allocate(
            self.num_layers, num_slots, max_len, entry, dtype=self.dtype, device=device, table=table
        )

    def embed(self, ids: Tensor) -> Tensor:
        """``ids: [T] int64`` -> ``[T, H]``. No collective: with a parallel shard, rank 0's (the drafts')."""
        return self.model.embed_tokens.embed_whole(ids)

    def lm_head(self, hidden: Tensor) -> Tensor:
        """``hidden: [N, H]`` (already normed) -> ``[N, V] float32``. No collective: with a parallel shard, rank
        0's (the drafts')."""
        return self._head().logits_whole(hidden)

    def _head(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.tied else self.lm_head_proj

    def forward(
        self, batch: ForwardBatch, cache: KVCache, *, return_hidden: bool = False, return_aux: bool = False
    ) -> TargetOutput:
        """Logits ``[N, V] float32`` at ``batch.logits_indices``; ``hidden [T, H]`` after the final norm;
        ``aux_hidden [T, len(aux_layer_ids) * H]``: the inputs of layers ``aux_layer_ids`` (id L = final output).

        The host's part (the cache's checks, the layout), then :meth:`forward_layout`."""
        cache.begin_forward(batch.spans)
        layout = RaggedLayout.build(batch, cache)
        return self.forward_layout(
            layout, batch.input_ids, batch.positions, cache.layers, batch.logits_indices, return_hidden, return_aux
        )

    def forward_layout(
        self,
        layout: RaggedLayout,
        input_ids: Tensor,
        positions: Tensor,
        layers: list[Tensor],
        logits_indices: Tensor | None = None,
        return_hidden: bool = False,
        return_aux: bool = False,
    ) -> TargetOutput:
        """The forward's tensor body over a planned ``layout`` (:meth:`forward`'s outputs): ``input_ids,
        positions [T] int64``, ``layers`` the cache's per-layer tensors. Reads nothing back from the
        device, so it compiles into one graph (``torch.compile(fullgraph=True)``, :mod:`tandem.engine.graphs`)."""
        rope = self.rotary(positions, layout.max_key)
        x = self.model.embed_tokens(input_ids)
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if return_aux and i in self.aux_layer_ids:
                captured[i] = x
            x = layer(x, rope, layout, layers[i])
        hidden = self.model.norm(x)
        if return_aux:
            captured[self.num_layers] = hidden
            aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        selected = hidden if logits_indices is None else hidden[logits_indices]
        return TargetOutput(
            logits=self._head().logits(selected),
            hidden=hidden if return_hidden else None,
            aux_hidden=aux if return_aux else None,
        )


def build(
    config: LlamaConfig,
    weights: WeightReader,
    *,
    dtype: torch.dtype,
    device: torch.device,
    target: None = None,
    shard: Shard = SINGLE,
) -> Llama3:
    """The loading registry's builder for ``model_type == "llama"``; a parallel ``shard`` reads its pieces only."""
    model = Llama3(config, dtype=dtype, device="meta", shard=shard).to_empty(device=device)  # weights follow
    model.load(weights)
    return model.eval().requires_grad_(False)
