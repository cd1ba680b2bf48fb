"""Rotary position embeddings: each position's rotation, tabled once, and its application to queries and keys.

Two layouts, one table class each: the half-split form of Llama checkpoints (:class:`Rotary`, with
transformers' rope types: linear, dynamic, llama3, yarn, longrope) and the interleaved form of
DeepSeek-V3's MLA (:class:`RotaryEmbedding`, optional YaRN). Settings come typed
(:class:`~tandem.models.config.RopeParameters`). A provider calls its table once per forward for
the batch's positions and gets the step's :class:`Rotation`; every layer rotates its queries and
keys with ``rope.apply(x)``, whatever the layout and the form.

Two forms of one rotation (the CPU fast path, chosen in :meth:`RotaryTable.__call__` only):

- a step of few tokens (decode, verify, drafting: at most :data:`MAX_ROTATION_MATRIX_TOKENS`)
  gets each position's rotation as a ``[dim, dim]`` matrix (:class:`RotationMatrices`), built once
  per forward, which every layer applies to all its rotated heads in one ``bmm``. Reason: on
  small models a step of few tokens is paid per op, and the elementwise form takes several.
- a longer step (a prefill) rotates elementwise (:class:`HalfSplitRotation`,
  :class:`InterleavedRotation`): its matrices would grow with ``T * dim**2``.

Invariant: each output of either form is the same two products, cos and sin terms, summed (the
matrix's other terms are exact zeros), so both give the same results up to the rounding of that
sum.

DeepSeek stores the rotary dimensions as interleaved pairs ``(x0, x1), (x2, x3), ...``,
each pair rotated by one frequency. Like transformers' ``apply_rotary_pos_emb_interleave``
the rotated vector comes out de-interleaved (``[real parts | imaginary parts]``); queries
and keys get the same permutation, so their dot products are those of the interleaved
rotation, and the cached keys stay in that layout.

YaRN (``rope_type == "yarn"``) follows the DeepSeek reference and transformers 5.23:
frequencies blend interpolation and extrapolation over the correction range set by
``beta_fast``/``beta_slow``; cos/sin are scaled by ``mscale(factor, mscale) /
mscale(factor, mscale_all_dim)`` and the attention softmax scale by
``mscale(factor, mscale_all_dim) ** 2`` (:attr:`RotaryEmbedding.softmax_scale_factor`). Llama's
attention keeps its softmax scale (transformers' Llama applies only the cos/sin scale).

Rope types that depend on the row's length (``"dynamic"``, ``"longrope"``) rotate the token at
position ``p`` by the frequencies of a row of ``p + 1`` tokens, which is what transformers computes
when it decodes token by token (its frequencies follow the longest position of each forward). So a
row within ``max_position_embeddings`` (dynamic) or ``original_max_position_embeddings`` (longrope)
rotates exactly as the plain/short frequencies do; past it, each new token's query and key use the
frequencies stretched for its own length (dynamic: ``rope_theta * (factor * (p + 1) / max_len -
(factor - 1)) ** (dim / (dim - 2))``; longrope: the long factors), while the keys already cached keep
the rotation they were written with, as transformers' cache keeps them. Per position rather than per
forward, a token's rotation never depends on how many tokens a step verifies or which rows share the
batch, so speculative decoding stays exact; transformers' one-forward prefill of a prompt longer than
those lengths instead stretches all its tokens for the whole prompt.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from tandem.models.config import RopeParameters

MAX_ROTATION_MATRIX_TOKENS = 64  # rotation matrices cost T * dim**2 numbers: only for decode-sized steps


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rope: RopeParameters, dim: int) -> tuple[Tensor, float, float]:
    """YaRN inverse frequencies ``[dim // 2] float32``, the cos/sin scale and the softmax-scale factor."""
    base, factor, original_max = rope.rope_theta, rope.factor, rope.original_max_position_embeddings
    mscale, mscale_all_dim = rope.mscale, rope.mscale_all_dim
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else yarn_mscale(factor)
        )

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
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


LENGTH_DEPENDENT = ("dynamic", "longrope")  # rope types whose frequencies follow the row's length


def rope_inv_freq(rope: RopeParameters, head_dim: int, lengths: Tensor | None = None) -> Tensor:
    """Inverse frequencies ``[head_dim // 2] float32`` of ``rope``'s type, or ``[N, head_dim // 2]`` for
    rows of ``lengths: [N]`` tokens (only dynamic and longrope depend on them; None: a row within the
    original context), as transformers' ``ROPE_INIT_FUNCTIONS`` compute them:

    - linear: divided by ``factor``;
    - dynamic: ``rope_theta`` becomes ``rope_theta * (factor * L / max_len - (factor - 1)) ** (dim /
      (dim - 2))`` for a row of ``L > max_len`` tokens;
    - llama3: wavelengths shorter than ``original_max / high_freq_factor`` keep their frequency, those
      longer than ``original_max / low_freq_factor`` are divided by ``factor``, the band between
      interpolates smoothly;
    - yarn: interpolation and extrapolation blended over the correction range;
    - longrope: each frequency divided by its ``short_factor``, or ``long_factor`` for rows longer
      than ``original_max``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / rope.rope_theta**exponents
    if rope.rope_type == "dynamic" and lengths is not None:
        max_len = rope.max_position_embeddings
        stretch = rope.factor * lengths.double().clamp(min=max_len) / max_len - (rope.factor - 1)
        stretched = 1.0 / (rope.rope_theta * stretch ** (head_dim / (head_dim - 2))).float()[:, None] ** exponents
        return torch.where(lengths[:, None] > max_len, stretched, inv_freq)
    if rope.rope_type == "longrope":
        short, long = (torch.tensor(f, dtype=torch.float32) for f in (rope.short_factor, rope.long_factor))
        if lengths is None:
            return inv_freq / short
        beyond = lengths[:, None] > rope.original_max_position_embeddings
        return torch.where(beyond, inv_freq / long, inv_freq / short)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "yarn":
        inv_freq = _yarn(rope, head_dim)[0]
    elif rope.rope_type == "llama3":
        factor, original_max = rope.factor, rope.original_max_position_embeddings
        low, high = rope.low_freq_factor, rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original_max / wavelen - low) / (high - low)).clamp(0, 1)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > original_max / low, inv_freq / factor, blended)
    return inv_freq if lengths is None else inv_freq.expand(len(lengths), -1)


def rope_attention_factor(rope: RopeParameters, head_dim: int) -> float:
    """The factor of cos and sin (so of queries and keys): yarn's ``mscale`` ratio, longrope's
    ``sqrt(1 + ln(factor) / ln(original_max))`` (``factor`` defaulting to ``max_len / original_max``),
    either overridden by ``attention_factor``; 1 for the other types."""
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)[1]
    if rope.rope_type != "longrope":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    original_max = rope.original_max_position_embeddings
    factor = rope.factor or rope.max_position_embeddings / original_max
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_max))


class Rotation(Protocol):
    """The rotation of one step's positions, as a rotary table returned it."""

    def apply(self, x: Tensor) -> Tensor:
        """Rotate ``x: [T, heads, dim]`` (in the model's dtype), token t by position t's angles;
        returns ``[T, heads, dim]``."""
        ...


class RotationMatrices:
    """Each position's rotation as a matrix, ``[T, dim, dim]`` with ``x @ R[t]`` the rotated ``x``
    (:func:`rotation_matrices`): one ``bmm`` rotates all of a layer's heads."""

    __slots__ = ("matrices",)

    def __init__(self, matrices: Tensor):
        self.matrices = matrices

    def apply(self, x: Tensor) -> Tensor:
        return torch.bmm(x, self.matrices)


class HalfSplitRotation:
    """Llama's elementwise rotation ``x * cos + rotate_half(x) * sin`` from ``cos, signed_sin: [T, dim]``;
    the sine's first half is negated, which turns ``rotate_half(x) * sin`` into ``roll(x) * signed sin``."""

    __slots__ = ("cos", "signed_sin")

    def __init__(self, cos: Tensor, signed_sin: Tensor):
        self.cos, self.signed_sin = cos, signed_sin

    def apply(self, x: Tensor) -> Tensor:
        return x * self.cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * self.signed_sin[:, None]


class InterleavedRotation:
    """DeepSeek's elementwise rotation of interleaved pairs from ``cos, sin: [T, dim]`` (both halves of
    the columns hold the same angles); the output is de-interleaved (see the module docstring)."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: Tensor, sin: Tensor):
        self.cos, self.sin = cos, sin

    def apply(self, x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        cos, sin = self.cos[:, None, :half], self.sin[:, None, :half]
        real, imag = x[..., 0::2], x[..., 1::2]
        return torch.cat([real * cos - imag * sin, imag * cos + real * sin], dim=-1)


def rotation_matrices(cos: Tensor, sin: Tensor, cos_pattern: Tensor, sin_pattern: Tensor) -> Tensor:
    """Per-position rotations ``[T, dim, dim]`` with ``x @ R[t]`` the rotated ``x``: ``R[t] =
    cos_pattern * cos[t] + sin_pattern * sin[t]``, from ``cos, sin: [T, dim]`` (each output
    column's angle) and the ``[dim, dim]`` patterns of where each input lands (entries 0 or ±1)."""
    return cos_pattern * cos[:, None, :] + sin_pattern * sin[:, None, :]


class RotaryTable:
    """Each position's rotary cos and sin, tabled once and looked up per step (vLLM's ``cos_sin_cache``),
    and the rotation they make. Not an ``nn.Module``: no weights.

    The table covers positions ``0 .. end - 1`` of the furthest step so far, doubling when a step
    reaches past it: a decode step pays one lookup instead of computing its angles. Entries are
    computed in float32 and then cast to the model's dtype, like HF.

    Args:
        freq: ``[dim]`` float32 angle per position of each output column.
        cos_scale, sin_scale: ``[dim]`` (or scalar) factors of the cosines and sines.
        cos_pattern, sin_pattern: ``[dim, dim]``, where each input lands (:func:`rotation_matrices`).
        dtype: the model's.
    """

    elementwise: type[HalfSplitRotation] | type[InterleavedRotation]  # the layout's elementwise form

    def __init__(
        self,
        freq: Tensor,
        cos_scale: Tensor | float,
        sin_scale: Tensor | float,
        cos_pattern: Tensor,
        sin_pattern: Tensor,
        dtype: torch.dtype,
    ):
        self.freq, self.cos_scale, self.sin_scale = freq, torch.as_tensor(cos_scale), torch.as_tensor(sin_scale)
        self.cos_pattern, self.sin_pattern = cos_pattern.to(dtype), sin_pattern.to(dtype)
        self.table = torch.empty(0, 2, len(freq), dtype=dtype)  # [positions, (cos, sin), dim]

    def __call__(self, positions: Tensor, end: int) -> Rotation:
        """The rotation of ``positions: [T] int64``, all below ``end``: :class:`RotationMatrices` when
        ``T <= MAX_ROTATION_MATRIX_TOKENS``, else the elementwise form; in the model's dtype."""
        if len(self.table) < end or self.table.device != positions.device:
            self._build(max(end, 2 * len(self.table), 256), positions.device)
        cos, sin = self.table[positions].unbind(1)
        if positions.shape[0] > MAX_ROTATION_MATRIX_TOKENS:
            return self.elementwise(cos, sin)
        return RotationMatrices(rotation_matrices(cos, sin, self.cos_pattern, self.sin_pattern))

    def _angles(self, size: int, device: torch.device) -> Tensor:
        """``[size, dim] float32``: each output column's angle at positions ``0 .. size - 1``."""
        return torch.arange(size, dtype=torch.float32, device=device)[:, None] * self.freq.to(device)

    def _build(self, size: int, device: torch.device) -> None:
        angles = self._angles(size, device)
        cos, sin = angles.cos() * self.cos_scale.to(device), angles.sin() * self.sin_scale.to(device)
        self.table = torch.stack([cos, sin], dim=1).to(self.table.dtype)
        self.cos_pattern, self.sin_pattern = self.cos_pattern.to(device), self.sin_pattern.to(device)


class Rotary(RotaryTable):
    """Half-split (GPT-NeoX layout) RoPE, as HF Llama checkpoints expect, of any of transformers' rope
    types (:func:`rope_inv_freq`; the length-dependent ones per position, see the module docstring).

    The sine's first half is negated (:class:`HalfSplitRotation`), so the matrix of a position is
    ``R = identity * cos + half_turn * signed sin``; yarn and longrope scale both by
    :func:`rope_attention_factor`.
    """

    elementwise = HalfSplitRotation

    def __init__(self, rope: RopeParameters, head_dim: int, dtype: torch.dtype):
        self.rope, self.head_dim = rope, head_dim
        inv_freq, scale = rope_inv_freq(rope, head_dim), rope_attention_factor(rope, head_dim)
        sin_sign = torch.cat([-torch.ones_like(inv_freq), torch.ones_like(inv_freq)])
        identity = torch.eye(head_dim)
        half_turn = identity.roll(head_dim // 2, dims=0)  # rotate_half as a matrix: x @ half_turn == roll(x)
        # Both halves rotate by the same angles.
        super().__init__(torch.cat([inv_freq, inv_freq]), scale, sin_sign * scale, identity, half_turn, dtype)

    def _angles(self, size: int, device: torch.device) -> Tensor:
        if self.rope.rope_type not in LENGTH_DEPENDENT:
            return super()._angles(size, device)
        positions = torch.arange(size)
        inv_freq = rope_inv_freq(self.rope, self.head_dim, positions + 1)  # [size, dim / 2]: position p, p + 1 tokens
        return (positions[:, None] * inv_freq.repeat(1, 2)).to(device)


class RotaryEmbedding(RotaryTable):
    """Interleaved RoPE, YaRN-scaled when ``rope`` asks for it.

    Args:
        rope: the model's rotary settings (``"default"`` or ``"yarn"``).
        dim: rotary dimensions per head (``qk_rope_head_dim``), even.
        dtype: the model's.
    """

    elementwise = InterleavedRotation

    def __init__(self, rope: RopeParameters, dim: int, dtype: torch.dtype):
        if dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {dim}")
        if rope.rope_type == "yarn":
            inv_freq, self.attention_factor, self.softmax_scale_factor = _yarn(rope, dim)
        else:
            inv_freq = 1.0 / rope.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
            self.attention_factor, self.softmax_scale_factor = 1.0, 1.0
        self.inv_freq = inv_freq  # [dim // 2] float32
        # Pair i = (x[2i], x[2i+1]) rotates into output columns i (real) and dim/2 + i (imaginary).
        half, pairs = dim // 2, torch.arange(dim // 2)
        cos_pattern, sin_pattern = torch.zeros(dim, dim), torch.zeros(dim, dim)
        cos_pattern[2 * pairs, pairs] = cos_pattern[2 * pairs + 1, half + pairs] = 1
        sin_pattern[2 * pairs + 1, pairs], sin_pattern[2 * pairs, half + pairs] = -1, 1
        factor = self.attention_factor
        super().__init__(inv_freq.repeat(2), factor, factor, cos_pattern, sin_pattern, dtype)
