"""apply_bitmask_triton: the same masked logits as the torch unpack, in place."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.bitmask import pack_bitmask, unpack_bitmask
from tandem.kernels import apply_bitmask_triton
from tandem.kernels import bitmask as bitmask_module
from tests.decoding.strategies import random_allowed

from .cases import DEVICE


@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 300),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.sampled_from([32, 128, 4096]),
    st.integers(0, 2**31 - 1),
)
@settings(max_examples=25)
def test_apply_bitmask_equals_the_torch_unpack(rows, positions, vocab_size, dtype, block, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, positions, vocab_size, generator=generator).to(dtype)
    allowed = random_allowed(generator, (rows, positions, vocab_size), density=0.4)
    bitmask = pack_bitmask(allowed)
    bitmask[..., -1] |= -(2**31)  # bits past V are ignored (set the top bit of the last word)
    expected = logits.masked_fill(~unpack_bitmask(bitmask, vocab_size), float("-inf"))
    on_device = logits.to(DEVICE)
    saved, bitmask_module.MAX_BLOCK = bitmask_module.MAX_BLOCK, block
    try:
        apply_bitmask_triton(on_device, bitmask.to(DEVICE))
    finally:
        bitmask_module.MAX_BLOCK = saved
    assert torch.equal(on_device.cpu(), expected)


def test_apply_bitmask_names_the_bad_argument():
    logits = torch.zeros(2, 40, device=DEVICE)
    with pytest.raises(ValueError, match=r"bitmask must have shape \[2, 2\], got \[2, 1\]"):
        apply_bitmask_triton(logits, torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="bitmask must be int32, got int64"):
        apply_bitmask_triton(logits, torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in the vocabulary dimension"):
        apply_bitmask_triton(torch.zeros(40, 2, device=DEVICE).T, torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))
