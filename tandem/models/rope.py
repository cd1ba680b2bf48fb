"""Rotary position embedding as DeepSeek-V3's MLA uses it: interleaved pairs, optional YaRN.

DeepSeek stores the rotary dimensions as interleaved pairs ``(x0, x1), (x2, x3), ...``,
each pair rotated by one frequency. Like transformers' ``apply_rotary_pos_emb_interleave``
the rotated vector comes out de-interleaved (``[real parts | imaginary parts]``); queries
and keys get the same permutation, so their dot products are those of the interleaved
rotation, and the cached keys stay in that layout.

YaRN (``rope_type``/``type == "yarn"``) follows the DeepSeek reference and transformers 5.23:
frequencies blend interpolation and extrapolation over the correction range set by
``beta_fast``/``beta_slow``; cos/sin are scaled by ``mscale(factor, mscale) /
mscale(factor, mscale_all_dim)`` and the attention softmax scale by
``mscale(factor, mscale_all_dim) ** 2`` (:attr:`RotaryEmbedding.softmax_scale_factor`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_parameters(config: dict[str, Any], supported: tuple[str, ...], model: str) -> dict[str, Any]:
    """The RoPE settings of an HF config dict, in one shape whatever the config's vintage.

    Reads transformers-5 ``rope_parameters`` or the older ``rope_scaling`` + ``rope_theta``
    (the published Llama 3 / DeepSeek-V3 configs). Returns a dict with at least ``rope_type`` and
    ``rope_theta`` (default 10000: the official EAGLE-3 Llama-3.1 draft config has none); the
    scaling keys are passed through unchanged. Raises ValueError for a type not in `supported`.
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if params["rope_type"] not in supported:
        expected = " or ".join(repr(t) for t in supported)
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported for {model} (expected {expected})")
    return params


def _yarn(params: dict[str, Any], dim: int, max_position_embeddings: int) -> tuple[Tensor, float, float]:
    """YaRN inverse frequencies ``[dim // 2] float32``, the cos/sin scale and the softmax-scale factor."""
    base = float(params["rope_theta"])
    original_max = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original_max
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else yarn_mscale(factor)
        )

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    softmax_scale_factor = yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return inv_freq, float(attention_factor), softmax_scale_factor


Rope = Tensor | tuple[Tensor, Tensor]  # a rotary's output: rotation matrices, or an elementwise (cos, sin) pair
MAX_ROTATION_MATRIX_TOKENS = 64  # rotation matrices cost T * dim**2 numbers: only for decode-sized steps


def rotation_matrices(cos: Tensor, sin: Tensor, cos_pattern: Tensor, sin_pattern: Tensor) -> Tensor:
    """Per-position rotations ``[T, dim, dim]`` with ``x @ R[t]`` the rotated ``x``: ``R[t] =
    cos_pattern * cos[t] + sin_pattern * sin[t]``, from ``cos, sin: [T, dim]`` (each output
    column's angle) and the ``[dim, dim]`` patterns of where each input lands (entries 0 or ±1).

    On small models a step of few tokens is paid per op: a rotation as one ``bmm`` per layer
    replaces four to seven elementwise ops. Each output is the same two products summed as the
    elementwise form (the other terms are exact zeros).
    """
    return cos_pattern * cos[:, None, :] + sin_pattern * sin[:, None, :]


class RotaryEmbedding:
    """Interleaved RoPE frequencies, YaRN-scaled when the config asks for it. Not an ``nn.Module``: no weights.

    Args:
        config: the model's HF config dict (``rope_parameters`` or ``rope_scaling``/``rope_theta``,
            ``max_position_embeddings``).
        dim: rotary dimensions per head (``qk_rope_head_dim``), even.
        dtype: of the rotation matrices (the model's).
    """

    def __init__(self, config: dict[str, Any], dim: int, dtype: torch.dtype = torch.float32):
        if dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {dim}")
        params = rope_parameters(config, ("default", "yarn"), "DeepSeek-V3")
        if params["rope_type"] == "yarn":
            inv_freq, self.attention_factor, self.softmax_scale_factor = _yarn(
                params, dim, config["max_position_embeddings"]
            )
        else:
            inv_freq = 1.0 / float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
            self.attention_factor, self.softmax_scale_factor = 1.0, 1.0
        self.inv_freq = inv_freq  # [dim // 2] float32
        # Pair i = (x[2i], x[2i+1]) rotates into output columns i (real) and dim/2 + i (imaginary).
        half, pairs = dim // 2, torch.arange(dim // 2)
        self.cos_pattern, self.sin_pattern = torch.zeros(dim, dim, dtype=dtype), torch.zeros(dim, dim, dtype=dtype)
        self.cos_pattern[2 * pairs, pairs] = self.cos_pattern[2 * pairs + 1, half + pairs] = 1
        self.sin_pattern[2 * pairs + 1, pairs], self.sin_pattern[2 * pairs, half + pairs] = -1, 1
        self.dtype = dtype

    def __call__(self, positions: Tensor) -> Rope:
        """``positions: [T] int64`` -> the rotations ``[T, dim, dim]`` in the model's dtype when
        ``T <= MAX_ROTATION_MATRIX_TOKENS``, else ``(cos, sin)``, each ``[T, dim // 2] float32``;
        YaRN-scaled."""
        if self.inv_freq.device != positions.device:  # follows the model to its device once
            self.inv_freq, self.cos_pattern, self.sin_pattern = (
                t.to(positions.device) for t in (self.inv_freq, self.cos_pattern, self.sin_pattern))
        angles = positions.to(torch.float32)[:, None] * self.inv_freq
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        if len(positions) > MAX_ROTATION_MATRIX_TOKENS:
            return cos, sin
        cos, sin = cos.repeat(1, 2).to(self.dtype), sin.repeat(1, 2).to(self.dtype)
        return rotation_matrices(cos, sin, self.cos_pattern, self.sin_pattern)


def apply_interleaved_rotary(x: Tensor, rope: Rope) -> Tensor:
    """Rotate interleaved pairs of ``x: [T, heads, dim]`` by what :class:`RotaryEmbedding` returned
    for its positions. Returns ``[T, heads, dim]`` in x's dtype, de-interleaved (see the module docstring).
    """
    if isinstance(rope, Tensor):
        return torch.bmm(x, rope)
    cos, sin = (t[:, None].to(x.dtype) for t in rope)
    real, imag = x[..., 0::2], x[..., 1::2]
    return torch.cat([real * cos - imag * sin, imag * cos + real * sin], dim=-1)
