"""tandem's counter-based uniforms (tandem/core/rng.py) inside Triton kernels, bit for bit.

The hash is the torch path's own (lowbias32 over seed, stream, counter), so a kernel's draw for
(seed, stream, counter) equals `tandem.core.rng.uniform`'s: the acceptance tests of both paths
use the same uniforms, and a row's draws depend only on its seed. Two mixer rounds per element
(the per-row state is hashed once) instead of Philox's ten.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 values (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def stream_state(seed, stream: tl.constexpr):
    """uint32 state of one row's stream; seed: int64 scalar (all 64 bits are used)."""
    state = _mix32((seed & 0xFFFFFFFF).to(tl.uint32))
    state = _mix32(state ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(state ^ stream)


@triton.jit
def random_bits(state, counter):
    """24 random bits (int32 in [0, 2**24)) per counter (int32 >= 0) of the stream `state`."""
    bits = _mix32(_mix32(state ^ counter.to(tl.uint32)) ^ 0x9E3779B9)
    return (bits >> 8).to(tl.int32)


@triton.jit
def uniform(state, counter):
    """float32 uniforms in (0, 1], multiples of 2**-24: `tandem.core.rng.uniform`'s values."""
    return (random_bits(state, counter) + 1).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def exponential(state, counter, FAST_LOG: tl.constexpr):
    """E ~ Exp(1), one per counter, accurate where it matters for a race: small E.

    E = -log(1 - w) with w = (bits + 1/2) / 2**24, the midpoint of its 2**-24 bin (so the
    quantised law of small E is unbiased and E is never 0). Small w go through
    2 atanh(w / (2 - w)) (series to t**5, relative error < 2e-10) instead of log(1 - w), whose
    cancellation near 1 would wreck exactly the small E that decide which unlikely token wins;
    1 - w is formed from the bits directly, so it is exact where it is small (large E).
    FAST_LOG (compiled kernels only; the interpreter has no libdevice) takes that log with the
    hardware's approximate lg2, which errs by < 3e-6 relative on E >= 0.06 and shortens the race
    kernel noticeably at large vocabularies.
    """
    bits = random_bits(state, counter)
    w = (bits.to(tl.float32) + 0.5) * 5.9604644775390625e-08
    one_minus_w = ((16777216 - bits).to(tl.float32) - 0.5) * 5.9604644775390625e-08
    t = w / (2.0 - w)
    t2 = t * t
    small = 2.0 * t * (1.0 + t2 * (1.0 / 3.0 + t2 * 0.2))
    if FAST_LOG:
        large = -libdevice.fast_logf(one_minus_w)
    else:
        large = -tl.log(one_minus_w)
    return tl.where(w < 0.0625, small, large)
