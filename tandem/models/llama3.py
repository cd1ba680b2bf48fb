"""Llama 3 target: GQA attention over a slot KV cache, RoPE with ``llama3`` frequency scaling.

Module and parameter names mirror the published checkpoints (``model.layers.{i}.self_attn.
q_proj.weight``, ``lm_head.weight``, ...), so loading is one pass over ``named_parameters``.
The building blocks (:class:`RMSNorm`, :class:`Rotary`, :class:`Attention`, :class:`MLP`,
:class:`DecoderLayer`, :class:`RaggedLayout`) are shared with the EAGLE and EAGLE-3 drafts.

Attention over a ragged batch: queries are scattered into a padded ``[B, Qmax]`` grid, each
row's cache slot is gathered as ``[B, Lmax]`` keys, and one ``scaled_dot_product_attention``
call runs with the mask ``first_position <= key position <= query position``. The cache entry
per token and layer is the stacked ``(K, V)``: ``[2, num_key_value_heads, head_dim]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.models.base import ForwardBatch, KVCache, TargetOutput, default_aux_layer_ids
from tandem.models.loading import WeightReader, load_module
from tandem.models.rope import rope_parameters


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


class Rotary:
    """Half-split (GPT-NeoX layout) RoPE, as HF Llama checkpoints expect. Not an ``nn.Module``: no weights."""

    def __init__(self, config: dict[str, Any], head_dim: int):
        self.inv_freq = rope_inv_freq(config, head_dim)

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``positions: [T] int64`` -> ``(cos, sin)``, each ``[T, head_dim] float32``."""
        if self.inv_freq.device != positions.device:  # follows the model to its device once
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: [T, heads, head_dim]`` by ``cos, sin: [T, head_dim]``; returns x's dtype."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in float32 like HF's LlamaRMSNorm. ``x: [..., D]``."""

    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


@dataclass
class RaggedLayout:
    """Where each token of a ragged batch sits in a padded ``[B, Qmax]`` query grid, and what it sees.

    Built once per forward and shared by all layers.
    """

    token_rows: Tensor  # [T] int64: batch row of each token
    token_cols: Tensor  # [T] int64: index of the token within its row
    token_slots: Tensor  # [T] int64: cache slot of each token
    slots: Tensor  # [B] int64
    visible: Tensor  # [B, 1, Qmax, Lmax] bool: first_position <= key position <= query position

    @classmethod
    def build(cls, batch: ForwardBatch, first_position: int = 0) -> "RaggedLayout":
        token_rows = batch.token_rows()
        token_cols = torch.arange(batch.num_tokens, device=token_rows.device) - batch.row_offsets[token_rows]
        max_query, max_key = int(batch.row_offsets.diff().max()), int(batch.positions.max()) + 1
        # Padding queries see every key: their outputs are dropped, and no softmax row is empty.
        query_positions = batch.positions.new_full((batch.num_rows, max_query), max_key - 1)
        query_positions[token_rows, token_cols] = batch.positions
        keys = torch.arange(max_key, device=token_rows.device)
        visible = (keys <= query_positions[..., None]) & (keys >= first_position)
        return cls(token_rows, token_cols, batch.slots[token_rows], batch.slots, visible[:, None])

    def attend(self, q: Tensor, cache: Tensor, scale: float) -> Tensor:
        """Attention of ``q: [T, nh, d]`` over each row's slot of ``cache: [slots, max_len, 2, nkv, d]``.

        Returns ``[T, nh, d]``. Query heads are grouped over key/value heads (GQA).
        """
        num_rows, _, max_query, max_key = self.visible.shape
        padded = q.new_zeros(num_rows, max_query, *q.shape[1:])
        padded[self.token_rows, self.token_cols] = q
        kv = cache[self.slots, :max_key]  # [B, Lmax, 2, nkv, d]
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, nkv, Lmax, d]
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), k, v, attn_mask=self.visible, scale=scale, enable_gqa=True
        )  # [B, nh, Qmax, d]
        return out.transpose(1, 2)[self.token_rows, self.token_cols]


class Attention(nn.Module):
    """GQA self-attention writing into and reading from a slot cache. ``x: [T, input_size] -> [T, H]``.

    ``input_size`` is the hidden size except in EAGLE-3's draft layer (2 * hidden).
    """

    def __init__(self, config: dict[str, Any], input_size: int | None = None, **factory):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", False))
        input_size = input_size or hidden
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias, **factory)

    def forward(
        self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], layout: RaggedLayout, cache: Tensor
    ) -> Tensor:
        """Write the batch's K/V at ``positions [T]`` of ``cache [slots, max_len, 2, nkv, d]``, then attend."""
        q = apply_rotary(self.q_proj(x).view(len(x), self.num_heads, self.head_dim), *rope)
        k = apply_rotary(self.k_proj(x).view(len(x), self.num_kv_heads, self.head_dim), *rope)
        v = self.v_proj(x).view(len(x), self.num_kv_heads, self.head_dim)
        cache[layout.token_slots, positions] = torch.stack([k, v], dim=1).to(cache.dtype)
        out = layout.attend(q, cache, self.head_dim**-0.5)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))``: ``x: [T, H] -> [T, H]``."""

    def __init__(self, config: dict[str, Any], **factory):
        super().__init__()
        hidden, inner, bias = config["hidden_size"], config["intermediate_size"], bool(config.get("mlp_bias", False))
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, **factory)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def check_activation(config: dict[str, Any]) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Llama config hidden_act={config['hidden_act']!r} is not supported (expected 'silu')")


class DecoderLayer(nn.Module):
    """Pre-norm Llama block ``x: [T, H] -> [T, H]``. EAGLE-1's draft layer has no ``input_layernorm``."""

    def __init__(self, config: dict[str, Any], *, input_layernorm: bool = True, **factory):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps, **factory) if input_layernorm else nn.Identity()
        self.self_attn = Attention(config, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **factory)
        self.mlp = MLP(config, **factory)

    def forward(
        self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], layout: RaggedLayout, cache: Tensor
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, layout, cache)
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
        self.lm_head_proj = None if self.tied else nn.Linear(self.hidden_size, self.vocab_size, bias=False, **factory)
        self.rotary = Rotary(config, self.model.layers[0].self_attn.head_dim)

    # Checkpoint key of the head is ``lm_head.weight``; ``lm_head`` itself is the Target method.
    def load(self, weights: WeightReader) -> None:
        load_module(self.model, weights, "model.")
        if not self.tied:
            load_module(self.lm_head_proj, weights, "lm_head.")
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
        return F.linear(hidden, weight).float()

    def forward(
        self, batch: ForwardBatch, cache: KVCache, *, return_hidden: bool = False, return_aux: bool = False
    ) -> TargetOutput:
        """Logits ``[N, V] float32`` at ``batch.logits_indices``; ``hidden [T, H]`` after the final norm;
        ``aux_hidden [T, len(aux_layer_ids) * H]``: the inputs of layers ``aux_layer_ids`` (id L = final output)."""
        cache.begin_forward(batch)
        layout = RaggedLayout.build(batch)
        rope = self.rotary(batch.positions)
        x = self.embed(batch.input_ids)
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if return_aux and i in self.aux_layer_ids:
                captured[i] = x
            x = layer(x, batch.positions, rope, layout, cache.layers[i])
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
