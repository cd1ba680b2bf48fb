"""Counter-based random numbers keyed by per-row seeds.

A uniform is a pure function of (seed, stream, counter): a row's draws do not depend on
which other rows share the batch, nor on the device, and need no generator objects (so no
Python loop over rows). The hash absorbs each 32-bit word of the key with the `lowbias32`
mixer (Chris Wellons' hash-prospector, bias ~0.17 on the avalanche test). All arithmetic is
done in int64 on values below 2**32, splitting each multiply so nothing overflows.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF

# Streams: independent sequences for one seed. Each use of randomness gets its own.
STREAM_ACCEPT = 1  # the acceptance test of draft position j (counter = j)
STREAM_EMIT = 2  # the one token a call emits per row: recovered or bonus (counter = 0)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    high, low = constant >> 16, constant & 0xFFFF
    return ((((x * high) & 0xFFFF) << 16) + x * low) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def derive_seeds(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A fresh 62-bit seed per (seed, counter): the engine's per-step seeds.

    seed, counter: [B] int64 (e.g. a request's seed and its number of committed tokens)
    returns:       [B] int64, non-negative
    """
    state = _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    low = _mix32(_mix32(state ^ (counter & _MASK32)) ^ ((counter >> 32) & _MASK32))
    high = _mix32(low ^ 0x85EBCA6B)
    return ((high & 0x3FFFFFFF) << 32) | low


def uniform(seed: torch.Tensor, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1], one per (row, counter).

    seed:    [B] int64, any value (all 64 bits are used)
    counter: [N] int64, non-negative
    returns: [B, N] float32, multiples of 2**-24 in (0, 1]
    """
    state = _mix32(seed & _MASK32)
    state = _mix32(state ^ ((seed >> 32) & _MASK32))
    state = _mix32(state ^ stream)
    bits = _mix32(_mix32(state[:, None] ^ (counter[None, :] & _MASK32)) ^ 0x9E3779B9)
    return ((bits >> 8) + 1).to(torch.float32) * 2.0**-24
