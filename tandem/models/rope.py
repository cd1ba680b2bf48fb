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


class RotaryTable:
    """Each position's rotary cos and sin, tabled once and looked up per step (vLLM's ``cos_sin_cache``),
    and the rotation they make. Not an ``nn.Module``: no weights.

    The table covers positions ``0 .. end - 1`` of the furthest step so far, doubling when a step
    reaches past it: a decode step pays one lookup where computing its angles took six ops. Entries
    are computed in float32 and then cast to the model's dtype, like HF.

    Args:
        freq: ``[dim]`` float32 angle per position of each output column.
        cos_scale, sin_scale: ``[dim]`` (or scalar) factors of the cosines and sines.
        cos_pattern, sin_pattern: ``[dim, dim]``, where each input lands (:func:`rotation_matrices`).
        dtype: the model's.
    """

    def __init__(self, freq: Tensor, cos_scale: Tensor | float, sin_scale: Tensor | float, cos_pattern: Tensor,
                 sin_pattern: Tensor, dtype: torch.dtype):
        self.freq, self.cos_scale, self.sin_scale = freq, torch.as_tensor(cos_scale), torch.as_tensor(sin_scale)
        self.cos_pattern, self.sin_pattern = cos_pattern.to(dtype), sin_pattern.to(dtype)
        self.table = torch.empty(0, 2, len(freq), dtype=dtype)  # [positions, (cos, sin), dim]

    def __call__(self, positions: Tensor, end: int) -> Rope:
        """``positions: [T] int64``, all below ``end`` -> the rotations ``[T, dim, dim]`` when
        ``T <= MAX_ROTATION_MATRIX_TOKENS``, else ``(cos, sin)``, each ``[T, dim]``; in the model's dtype."""
        if len(self.table) < end or self.table.device != positions.device:
            self._build(max(end, 2 * len(self.table), 256), positions.device)
        cos, sin = self.table[positions].unbind(1)
        if positions.shape[0] > MAX_ROTATION_MATRIX_TOKENS:
            return cos, sin
        return rotation_matrices(cos, sin, self.cos_pattern, self.sin_pattern)

    def _build(self, size: int, device: torch.device) -> None:
        angles = torch.arange(size, dtype=torch.float32, device=device)[:, None] * self.freq.to(device)
        cos, sin = angles.cos() * self.cos_scale.to(device), angles.sin() * self.sin_scale.to(device)
        self.table = torch.stack([cos, sin], dim=1).to(self.table.dtype)
        self.cos_pattern, self.sin_pattern = self.cos_pattern.to(device), self.sin_pattern.to(device)


class RotaryEmbedding(RotaryTable):
    """Interleaved RoPE, YaRN-scaled when the config asks for it.

    Args:
        config: the model's HF config dict (``rope_parameters`` or ``rope_scaling``/``rope_theta``,
            ``max_position_embeddings``).
        dim: rotary dimensions per head (``qk_rope_head_dim``), even.
        dtype: the model's.
    """

    def __init__(self, config: dict[str, Any], dim: int, dtype: torch.dtype):
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
        cos_pattern, sin_pattern = torch.zeros(dim, dim), torch.zeros(dim, dim)
        cos_pattern[2 * pairs, pairs] = cos_pattern[2 * pairs + 1, half + pairs] = 1
        sin_pattern[2 * pairs + 1, pairs], sin_pattern[2 * pairs, half + pairs] = -1, 1
        factor = self.attention_factor
        super().__init__(inv_freq.repeat(2), factor, factor, cos_pattern, sin_pattern, dtype)


def apply_interleaved_rotary(x: Tensor, rope: Rope) -> Tensor:
    """Rotate interleaved pairs of ``x: [T, heads, dim]`` (in the model's dtype) by what
    :class:`RotaryEmbedding` returned for its positions. Returns ``[T, heads, dim]``, de-interleaved
    (see the module docstring).
    """
    if isinstance(rope, Tensor):
        return torch.bmm(x, rope)
    half = x.shape[-1] // 2  # both halves of the table's columns hold the same angles
    cos, sin = (t[:, None, :half] for t in rope)
    real, imag = x[..., 0::2], x[..., 1::2]
    return torch.cat([real * cos - imag * sin, imag * cos + real * sin], dim=-1)
