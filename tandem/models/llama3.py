"""Llama 3 target: GQA attention over a slot KV cache, RoPE with ``llama3`` frequency scaling.

Module names mirror the published checkpoints (``model.layers.{i}.self_attn.o_proj.weight``,
``lm_head.weight``, ...) except the merged projections, which name their parts' keys
(:func:`tandem.models.layers.checkpoint_tensors`), so loading is one pass over the module.
The building blocks (:class:`Rotary`, :class:`Attention`, :class:`DecoderLayer`,
:class:`RaggedLayout`) are shared with the EAGLE and EAGLE-3 drafts.

Attention over a ragged batch: queries sit in a padded ``[B, Qmax]`` grid, each row's cache
slot is read as ``[B, Lmax]`` keys from the cache's first position, and one
``scaled_dot_product_attention`` call runs with the mask ``key position <= query position``
(none for one token per row at each row's end). The cache entry per token and layer is the
stacked ``(K, V)``: ``[2, num_key_value_heads, head_dim]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.models.base import ForwardBatch, KVCache, TargetOutput, default_aux_layer_ids
from tandem.models.layers import GatedMLP, Layer, Linear, MergedLinear, RMSNorm, linear
from tandem.models.loading import WeightReader, load_module
from tandem.models.rope import Rope, RotaryTable, rope_parameters


def rope_inv_freq(config: dict[str, Any], head_dim: int) -> Tensor:
    """Inverse frequencies ``[head_dim // 2] float32``, llama3-scaled when the config asks for it.

    Llama 3.1 scaling: wavelengths shorter than ``original_max / high_freq_factor`` keep their
    frequency, those longer than ``original_max / low_freq_factor`` are divided by ``factor``,
    and the band between interpolates smoothly.
    """
    params = rope_parameters(config, ("default", "llama3"), "Llama")
    inv_freq = 1.0 / float(params["rope_theta"]) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if params["rope_type"] == "default":
        return inv_freq
    factor, original_max = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original_max / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original_max / low, inv_freq / factor, blended)


class Rotary(RotaryTable):
    """Half-split (GPT-NeoX layout) RoPE, as HF Llama checkpoints expect.

    A step of few tokens (decode, verify, drafting) gets each position's rotation as a
    ``[head_dim, head_dim]`` matrix (:func:`~tandem.models.rope.rotation_matrices`), built once per
    forward, that every layer applies to all its rotated heads in one ``bmm`` (:func:`apply_rotary`)
    where ``x * cos + rotate_half(x) * sin`` takes four ops. A longer step (a prefill) keeps the
    four: its matrices would grow with ``T * head_dim**2``. The sine's first half is negated, which
    turns ``rotate_half(x) * sin`` into ``roll(x) * signed sin``, and the matrix into
    ``R = identity * cos + half_turn * signed sin``.
    """

    def __init__(self, config: dict[str, Any], head_dim: int, dtype: torch.dtype):
        inv_freq = rope_inv_freq(config, head_dim)
        sin_sign = torch.cat([-torch.ones_like(inv_freq), torch.ones_like(inv_freq)])
        identity = torch.eye(head_dim)
        half_turn = identity.roll(head_dim // 2, dims=0)  # rotate_half as a matrix: x @ half_turn == roll(x)
        # Both halves rotate by the same angles.
        super().__init__(torch.cat([inv_freq, inv_freq]), 1.0, sin_sign, identity, half_turn, dtype)


def apply_rotary(x: Tensor, rope: Rope) -> Tensor:
    """Rotate ``x: [T, heads, head_dim]`` by what :class:`Rotary` returned for its positions."""
    if isinstance(rope, Tensor):
        return torch.bmm(x, rope)
    cos, signed_sin = (t[:, None] for t in rope)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass
class RaggedLayout:
    """Where each token of a ragged batch sits in a padded ``[B, Qmax]`` query grid, and what it sees.

    Built once per forward from the batch's host-side spans and shared by all layers. The common
    cases copy nothing: when every row has the same number of tokens (decode and verify steps) the
    grid is a view of the tokens, and when the rows' slots are consecutive their keys are a view of
    the cache. Keys start at ``key_start`` (a draft's cache holds nothing at position 0), so a
    step of one token per row at each row's end needs no mask.
    """

    token_slots: Tensor  # [T] int64: cache slot of each token
    positions: Tensor  # [T] int64: position of each token
    one_row: tuple[int, int] | None  # (slot, first position) when the batch is one row, else None
    slots: Tensor  # [B] int64
    grid_index: tuple[Tensor, Tensor] | None  # (row, column) [T] of each token in the grid; None: T == B * Qmax
    first_slot: int | None  # slots == first_slot + arange(B), or None (the keys are gathered)
    visible: Tensor | None  # [B, 1, Qmax, num_keys] bool: key position <= query position
    #                         (None when every query sees every key)
    max_query: int
    key_start: int  # position of the first key
    max_key: int  # one past the position of the last key
    _masks: dict[tuple, Tensor] = field(default_factory=dict, repr=False)  # attention_mask's, per (dtype, repeats)

    @property
    def num_keys(self) -> int:
        return self.max_key - self.key_start

    @classmethod
    def build(cls, batch: ForwardBatch, first_position: int = 0) -> "RaggedLayout":
        spans = batch.spans
        num_rows, num_tokens = batch.num_rows, batch.num_tokens
        ends = spans.ends()
        max_query, max_key = max(spans.lengths), max(ends)
        if num_tokens == num_rows * max_query:
            grid_index = None
            query_positions = batch.positions.view(num_rows, max_query)
            token_slots = batch.slots.repeat_interleave(max_query) if max_query > 1 else batch.slots
        else:
            token_rows = batch.token_rows()
            grid_index = token_rows, torch.arange(num_tokens, device=token_rows.device) - batch.row_offsets[token_rows]
            # Padding queries see every key: their outputs are dropped, and no softmax row is empty.
            query_positions = batch.positions.new_full((num_rows, max_query), max_key - 1)
            query_positions[grid_index] = batch.positions
            token_slots = batch.slots[token_rows]
        visible = None
        if max_query > 1 or min(ends) < max_key:
            keys = torch.arange(first_position, max_key, device=batch.positions.device)
            visible = (keys <= query_positions[..., None])[:, None]
        slots = spans.slots
        first_slot = slots[0] if slots == list(range(slots[0], slots[0] + num_rows)) else None
        one_row = (slots[0], spans.starts[0]) if num_rows == 1 else None
        return cls(token_slots, batch.positions, one_row, batch.slots, grid_index, first_slot, visible, max_query,
                   first_position, max_key)

    def write(self, cache: Tensor, entries: Tensor) -> None:
        """Store ``entries [T, ...]`` at each token's slot and position of ``cache [slots, max_len, ...]``.

        One row's tokens fill a slice of its slot: a copy, where the scatter to (slot, position)
        indices costs a decode step 2-3% (it runs in every layer).
        """
        if self.one_row is None:
            cache[self.token_slots, self.positions] = entries.to(cache.dtype)
        else:
            slot, start = self.one_row
            cache[slot, start : start + entries.shape[0]] = entries

    def attention_mask(self, dtype: torch.dtype, repeats: int = 1) -> Tensor | None:
        """``visible`` as ``scaled_dot_product_attention``'s additive mask (0 or -inf) in ``dtype``,
        ``[B, 1, Qmax * repeats, num_keys]`` with each query's row repeated ``repeats`` times (MLA
        folds its heads into the query axis); None when every query sees every key.

        Built by the first layer that asks and kept for the others: sdpa would convert a bool mask,
        and MLA expand it, in every layer.
        """
        if self.visible is None:
            return None
        if (dtype, repeats) not in self._masks:
            visible = self.visible
            if repeats > 1:
                visible = visible[..., None, :].expand(-1, -1, -1, repeats, -1).flatten(2, 3)
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[dtype, repeats] = mask.masked_fill_(~visible, float("-inf"))
        return self._masks[dtype, repeats]

    def to_grid(self, x: Tensor) -> Tensor:
        """``[T, ...]`` -> ``[B, Qmax, ...]`` (padding zero-filled)."""
        if self.grid_index is None:
            return x.view(self.slots.shape[0], self.max_query, *x.shape[1:])
        grid = x.new_zeros(self.slots.shape[0], self.max_query, *x.shape[1:])
        grid[self.grid_index] = x
        return grid

    def from_grid(self, grid: Tensor) -> Tensor:
        """``[B, Qmax, ...]`` -> ``[T, ...]``."""
        return grid.flatten(0, 1) if self.grid_index is None else grid[self.grid_index]

    def cache_rows(self, cache: Tensor) -> Tensor:
        """The rows' cache entries: ``cache [slots, max_len, ...]`` -> ``[B, num_keys, ...]``."""
        if self.first_slot is not None:
            return cache[self.first_slot : self.first_slot + self.slots.shape[0], self.key_start : self.max_key]
        return cache[:, self.key_start : self.max_key].index_select(0, self.slots)

    def attend(self, q: Tensor, cache: Tensor, scale: float) -> Tensor:
        """Attention of ``q: [T, nh, d]`` over each row's slot of ``cache: [slots, max_len, 2, nkv, d]``.

        Returns ``[T, nh, d]``. Query heads are grouped over key/value heads (GQA).
        """
        kv = self.cache_rows(cache)  # [B, Lmax, 2, nkv, d]
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, nkv, Lmax, d]
        out = F.scaled_dot_product_attention(
            self.to_grid(q).transpose(1, 2), k, v, attn_mask=self.attention_mask(q.dtype), scale=scale, enable_gqa=True
        )  # [B, nh, Qmax, d]
        return self.from_grid(out.transpose(1, 2))


class Attention(Layer):
    """GQA self-attention writing into and reading from a slot cache. ``x: [T, input_size] -> [T, H]``.

    ``input_size`` is the hidden size except in EAGLE-3's draft layer (2 * hidden). The q/k/v
    projections are one :class:`MergedLinear` (checkpoint keys ``q_proj``, ``k_proj``, ``v_proj``).
    """

    def __init__(self, config: dict[str, Any], input_size: int | None = None, **factory):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(input_size or hidden, parts, bias=bias, **factory)
        self.o_proj = Linear(q_size, hidden, bias=bias, **factory)

    def forward(self, x: Tensor, rope: Rope, layout: RaggedLayout, cache: Tensor) -> Tensor:
        """Write the batch's K/V into ``cache [slots, max_len, 2, nkv, d]`` at the tokens' positions, then
        attend (``rope``: what :class:`Rotary` returned for those positions)."""
        rotated_heads = self.num_heads + self.num_kv_heads
        num_tokens = x.shape[0]  # not len(x): a Python-level Tensor method, 4x slower in every layer
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, nh + 2 nkv, d]
        q, k = apply_rotary(qkv[:, :rotated_heads], rope).split([self.num_heads, self.num_kv_heads], dim=1)
        kv = torch.cat([k, qkv[:, rotated_heads:]], dim=1).view(num_tokens, 2, self.num_kv_heads, self.head_dim)
        layout.write(cache, kv)
        out = layout.attend(q, cache, self.head_dim**-0.5)
        return self.o_proj(out.flatten(1))


def check_activation(config: dict[str, Any]) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Llama config hidden_act={config['hidden_act']!r} is not supported (expected 'silu')")


class DecoderLayer(Layer):
    """Pre-norm Llama block ``x: [T, H] -> [T, H]``. EAGLE-1's draft layer has no ``input_layernorm``."""

    def __init__(self, config: dict[str, Any], *, input_layernorm: bool = True, **factory):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps, **factory) if input_layernorm else nn.Identity()
        self.self_attn = Attention(config, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **factory)
        self.mlp = GatedMLP(hidden, config["intermediate_size"], bias=bool(config.get("mlp_bias", False)), **factory)

    def forward(self, x: Tensor, rope: Rope, layout: RaggedLayout, cache: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layout, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def kv_entry_shape(attention: Attention) -> tuple[int, ...]:
    """One token's cache entry for ``attention``: ``(2, num_kv_heads, head_dim)``."""
    return (2, attention.num_kv_heads, attention.head_dim)


class _Body(nn.Module):
    """``model.*``: embeddings, decoder layers, final norm."""

    def __init__(self, config: dict[str, Any], **factory):
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"], **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, **factory) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6), **factory)


class Llama3(nn.Module):
    """The Llama 3 target (implements :class:`tandem.models.base.Target`)."""

    def __init__(self, config: dict[str, Any], *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        check_activation(config)
        self.config = config
        self.checkpoint_dir: Path | None = None
        self.vocab_size, self.hidden_size = config["vocab_size"], config["hidden_size"]
        self.num_layers = config["num_hidden_layers"]
        self.aux_layer_ids = default_aux_layer_ids(self.num_layers)
        factory = {"dtype": dtype, "device": device}
        self.model = _Body(config, **factory)
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.lm_head_proj = None if self.tied else Linear(self.hidden_size, self.vocab_size, bias=False, **factory)
        self.rotary = Rotary(config, self.model.layers[0].self_attn.head_dim, dtype)

    # Checkpoint key of the head is ``lm_head.weight``; ``lm_head`` itself is the Target method.
    def load(self, weights: WeightReader) -> None:
        load_module(self.model, weights.take, "model.")
        if not self.tied:
            load_module(self.lm_head_proj, weights.take, "lm_head.")
        weights.finish(ignore=[r"lm_head\.weight$"] if self.tied else [])

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """``num_layers`` caches ``[num_slots, max_len, 2, num_key_value_heads, head_dim]``."""
        entry = kv_entry_shape(self.model.layers[0].self_attn)
        param = self.model.embed_tokens.weight
        return KVCache.allocate(self.num_layers, num_slots, max_len, entry, dtype=param.dtype, device=param.device)

    def embed(self, ids: Tensor) -> Tensor:
        """``ids: [T] int64`` -> ``[T, H]``."""
        return self.model.embed_tokens(ids)

    def lm_head(self, hidden: Tensor) -> Tensor:
        """``hidden: [N, H]`` (already normed) -> ``[N, V] float32``."""
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head_proj.weight
        return linear(hidden, weight).float()

    def forward(
        self, batch: ForwardBatch, cache: KVCache, *, return_hidden: bool = False, return_aux: bool = False
    ) -> TargetOutput:
        """Logits ``[N, V] float32`` at ``batch.logits_indices``; ``hidden [T, H]`` after the final norm;
        ``aux_hidden [T, len(aux_layer_ids) * H]``: the inputs of layers ``aux_layer_ids`` (id L = final output)."""
        cache.begin_forward(batch)
        layout = RaggedLayout.build(batch)
        rope = self.rotary(batch.positions, layout.max_key)
        x = self.embed(batch.input_ids)
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if return_aux and i in self.aux_layer_ids:
                captured[i] = x
            x = layer(x, rope, layout, cache.layers[i])
        hidden = self.model.norm(x)
        if return_aux:
            captured[self.num_layers] = hidden
            aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        selected = hidden if batch.logits_indices is None else hidden[batch.logits_indices]
        return TargetOutput(
            logits=self.lm_head(selected),
            hidden=hidden if return_hidden else None,
            aux_hidden=aux if return_aux else None,
        )


def build(
    config: dict[str, Any],
    weights: WeightReader,
    *,
    dtype: torch.dtype,
    device: torch.device,
    target: None = None,
) -> Llama3:
    """The loading registry's builder for ``model_type == "llama"``."""
    model = Llama3(config, dtype=dtype, device="meta").to_empty(device=device)  # no random init: weights follow
    model.load(weights)
    return model.eval().requires_grad_(False)
