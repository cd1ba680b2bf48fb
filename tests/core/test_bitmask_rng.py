"""The bitmask layout (xgrammar's) and the counter-based random numbers."""

import numpy as np
import torch
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from tandem.core.bitmask import bitmask_width, pack_bitmask, token_allowed, unpack_bitmask, unpack_bitmask_ops
from tandem.core.rng import STREAM_ACCEPT, STREAM_EMIT, uniform
from tests.decoding.reference import ALPHA


@given(st.integers(1, 200), st.integers(0, 2**31 - 1))
@settings(max_examples=100)
def test_pack_then_unpack_is_the_identity(vocab_size, seed):
    allowed = torch.rand(3, vocab_size, generator=torch.Generator().manual_seed(seed)) < 0.5
    packed = pack_bitmask(allowed)
    assert packed.shape == (3, bitmask_width(vocab_size)) and packed.dtype == torch.int32
    assert torch.equal(unpack_bitmask(packed, vocab_size), allowed)
    tokens = torch.randint(vocab_size, (3, 5), generator=torch.Generator().manual_seed(seed))
    rows = packed.unsqueeze(1).expand(-1, 5, -1)
    assert torch.equal(token_allowed(rows, tokens), allowed.gather(-1, tokens))


@given(st.integers(1, 200), st.integers(0, 2**31 - 1))
@settings(max_examples=100)
def test_host_unpack_equals_the_torch_ops(vocab_size, seed):
    """The CPU's numpy unpack against the torch ops every other device runs, on any words (sign bits, bits past
    V) and on a strided view of a [B, k+1, W] buffer's column, as a draft's walk reads it."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (3, 4, bitmask_width(vocab_size)), dtype=torch.int32, generator=generator)
    for bitmask in (words, words[:, 2]):
        host = unpack_bitmask(bitmask, vocab_size)
        assert host.dtype == torch.bool and torch.equal(host, unpack_bitmask_ops(bitmask, vocab_size))


def test_layout_is_xgrammars():
    vocab_size = 100
    allowed = torch.rand(4, vocab_size, generator=torch.Generator().manual_seed(0)) < 0.5
    logits = torch.zeros(4, vocab_size)
    xgrammar.apply_token_bitmask_inplace(logits, pack_bitmask(allowed))
    assert torch.equal(logits == 0, allowed)


def test_uniforms_are_uniform_and_in_range():
    u = uniform(torch.arange(50_000), STREAM_EMIT, torch.arange(4)).flatten()
    assert 0 < float(u.min()) and float(u.max()) <= 1
    counts = np.histogram(u.numpy(), bins=64, range=(0, 1))[0]
    assert stats.chisquare(counts).pvalue > ALPHA


def test_uniforms_are_uncorrelated_across_seeds_streams_and_counters():
    seeds = torch.arange(50_000) * 2**33  # seeds differing only in their high word
    accept_draws = uniform(seeds, STREAM_ACCEPT, torch.arange(3))
    emit_draws = uniform(seeds, STREAM_EMIT, torch.arange(1))
    neighbours = uniform(seeds + 1, STREAM_ACCEPT, torch.arange(1))
    columns = torch.cat([accept_draws, emit_draws, neighbours], dim=1).double().numpy()
    corr = np.corrcoef(columns.T)
    off_diagonal = corr[~np.eye(len(corr), dtype=bool)]
    # |r| of independent uniforms over n draws is ~ N(0, 1/n): a 5-sigma bound.
    assert np.abs(off_diagonal).max() < 5 / np.sqrt(len(columns))


def test_uniforms_depend_only_on_seed_stream_and_counter():
    seeds = torch.tensor([3, -7, 2**62 + 5, 0])
    together = uniform(seeds, STREAM_ACCEPT, torch.arange(4))
    for b in range(4):
        assert torch.equal(uniform(seeds[b : b + 1], STREAM_ACCEPT, torch.arange(4)), together[b : b + 1])
    assert not torch.equal(uniform(seeds, STREAM_EMIT, torch.arange(4)), together)
