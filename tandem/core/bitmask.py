"""The token bitmask format shared by the grammar pipeline, `accept` and the kernels.

A bitmask over a vocabulary of V tokens is int32 `[..., W]` with `W = ceil(V / 32)`: token j
is allowed iff bit `j % 32` (LSB first) of word `j // 32` is set. This is xgrammar's and
llguidance's layout, so their matchers fill our buffers directly. Bits past V are ignored.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

# On a little-endian host a word's four bytes hold its bits 0-31 in order, LSB first: numpy unpacks them as tokens.
_HOST_UNPACKS = sys.byteorder == "little"


def bitmask_width(vocab_size: int) -> int:
    """W = ceil(V / 32): int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [..., W] -> bool [..., V], True = allowed. A CPU bitmask is unpacked by numpy, one call where torch
    takes six ops (a grammar row's draft pass and acceptance unpack one each step)."""
    if bitmask.is_cpu and _HOST_UNPACKS and not torch.compiler.is_compiling():
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(bits[..., :vocab_size]).view(torch.bool)
    return unpack_bitmask_ops(bitmask, vocab_size)


def unpack_bitmask_ops(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`unpack_bitmask` by torch ops, on any device."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [..., V] -> int32 [..., W]; the inverse of `unpack_bitmask`."""
    vocab_size = allowed.shape[-1]
    padded = torch.zeros(*allowed.shape[:-1], bitmask_width(vocab_size) * 32, dtype=torch.int64, device=allowed.device)
    padded[..., :vocab_size] = allowed.long()
    weights = torch.ones(32, dtype=torch.int64, device=allowed.device) << torch.arange(32, device=allowed.device)
    words = (padded.unflatten(-1, (-1, 32)) * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def token_allowed(bitmask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Whether each token is allowed by its own bitmask row, without unpacking the rest.

    bitmask: [..., W] int32; tokens: [...] int64 in [0, 32 * W)  ->  [...] bool
    """
    words = bitmask.gather(-1, (tokens // 32).unsqueeze(-1)).squeeze(-1)
    return ((words >> (tokens % 32).to(torch.int32)) & 1).bool()
