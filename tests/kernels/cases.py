"""Inputs shared by the kernel tests: small batches the CPU interpreter runs quickly."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from hypothesis import strategies as st

from tandem.decoding import accept
from tandem.kernels import acceptance as kernel_module
from tests.decoding.strategies import random_allowed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
accept_triton = functools.partial(accept, backend="triton")  # `accept` through the fused kernels


@contextmanager
def block_size(tokens: int):
    """Run the acceptance kernel with `tokens` per step of its passes (small = many blocks per pass)."""
    saved = kernel_module.MAX_BLOCK
    kernel_module.MAX_BLOCK = tokens
    try:
        yield
    finally:
        kernel_module.MAX_BLOCK = saved


@st.composite
def tie_heavy_batch(draw):
    """Logits on a coarse grid (ties within and across blocks), drafts that often match the
    masked argmax, optional masks with dead positions, placeholder drafts, any float dtype.

    returns logits [B, k+1, V], drafts [B, k] int64, allowed [B, k+1, V] bool or None, block size
    """
    batch = draw(st.integers(1, 8))
    k = draw(st.integers(0, 5))
    vocab_size = draw(st.integers(1, 96))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    logits = torch.randint(-3, 3, (batch, k + 1, vocab_size), generator=generator).to(dtype)
    allowed = None
    if draw(st.booleans()):
        allowed = random_allowed(generator, (batch, k + 1, vocab_size), density=draw(st.sampled_from([0.2, 0.7])))
        if draw(st.booleans()):  # some positions allow nothing
            allowed &= torch.rand(batch, k + 1, 1, generator=generator) > 0.2
    masked = logits.float() if allowed is None else logits.float().masked_fill(~allowed, float("-inf"))
    drafts = torch.where(
        torch.rand(batch, k, generator=generator) < 0.7,
        masked[:, :k].argmax(-1),
        torch.randint(vocab_size, (batch, k), generator=generator),
    )
    if draw(st.booleans()):  # padded rows: placeholder drafts and ids past the vocabulary
        drafts = torch.where(torch.rand(batch, k, generator=generator) < 0.2, -1, drafts)
        drafts[0, -1:] = vocab_size
    return logits, drafts, allowed, draw(st.sampled_from([16, 32, 4096]))
