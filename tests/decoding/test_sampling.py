"""`sample` and the target distribution: filters, masks and dead ends, against the reference."""

from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tandem.core.bitmask import pack_bitmask
from tandem.decoding import PLACEHOLDER_TOKEN_ID, SamplingTensors, accept, sample
from tandem.decoding import sampling as sampling_module
from tandem.decoding.sampling import argmax, mask_logits, target_probs

from .reference import assert_distributed_as, reference_probs
from .strategies import filter_settings, random_allowed


@st.composite
def position(draw):
    """Logits on a coarse grid (so ties occur), an optional mask and filter settings."""
    vocab_size = draw(st.integers(2, 32))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randint(-8, 8, (vocab_size,), generator=generator).float() / 2
    allowed = random_allowed(generator, (vocab_size,)) if draw(st.booleans()) else None
    return logits, allowed, draw(filter_settings(vocab_size))


def _ours(logits, allowed, settings_):
    bitmask = None if allowed is None else pack_bitmask(allowed)[None]
    masked, _ = mask_logits(logits[None], bitmask)
    return target_probs(masked, SamplingTensors.full(1, **settings_))[0].double().numpy()


@given(position(), st.sampled_from([None, 1, 2, 3, 5]))
@settings(max_examples=400)
def test_target_distribution_matches_reference(case, candidates):
    """`candidates` shrinks the top-p candidate set so both its exact cut and its fallback run."""
    logits, allowed, settings_ = case
    expected = reference_probs(logits, allowed, **settings_)
    if settings_["top_p"] < 1:  # float32 vs float64 cumulative sums may cut differently at the boundary
        ref = reference_probs(logits, allowed, **{**settings_, "top_p": 1.0})
        mass = np.sort(ref)[::-1].cumsum()
        assume(np.abs(mass - settings_["top_p"]).min() > 1e-5)
    with patch.object(sampling_module, "TOP_P_CANDIDATES", candidates or sampling_module.TOP_P_CANDIDATES):
        ours = _ours(logits, allowed, settings_)
    np.testing.assert_allclose(ours, expected, atol=1e-6)


@given(position())
@settings(max_examples=100)
def test_greedy_distribution_is_the_point_mass_at_the_first_masked_argmax(case):
    logits, allowed, settings_ = case
    expected = reference_probs(logits, allowed, temperature=0)
    np.testing.assert_array_equal(_ours(logits, allowed, {**settings_, "temperature": 0.0}), expected)


@pytest.mark.parametrize(
    "settings_",
    [
        {},
        {"temperature": 0.6},
        {"top_k": 4},
        {"top_p": 0.7},
        {"min_p": 0.1},
        {"temperature": 1.3, "top_k": 10, "top_p": 0.9, "min_p": 0.02},
    ],
    ids=["plain", "temperature", "top_k", "top_p", "min_p", "all_filters"],
)
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_sample_is_distributed_as_the_target(settings_, masked):
    vocab_size, rows = 24, 20_000
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(vocab_size, generator=generator) * 1.5
    allowed = random_allowed(generator, (vocab_size,)) if masked else None
    expected = reference_probs(logits, allowed, **{"temperature": 1.0, **settings_})
    bitmask = None if allowed is None else pack_bitmask(allowed).expand(rows, -1).contiguous()
    sampling = SamplingTensors.full(rows, seed=torch.arange(rows) + 1000, **settings_)
    tokens = sample(logits.expand(rows, -1), sampling, bitmask)
    assert_distributed_as(tokens, expected, f"sample {settings_} masked={masked}")


def test_sample_equals_accept_without_drafts():
    rows, vocab_size = 64, 40
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab_size, generator=generator)
    bitmask = pack_bitmask(random_allowed(generator, (rows, vocab_size)))
    temperature = torch.where(torch.arange(rows) % 3 == 0, 0.0, 0.8)
    sampling = SamplingTensors(
        temperature,
        torch.zeros(rows, dtype=torch.int64),
        torch.full((rows,), 0.9),
        torch.zeros(rows),
        torch.arange(rows),
    )
    result = accept(
        logits[:, None], torch.empty(rows, 0, dtype=torch.int64), sampling=sampling, bitmask=bitmask[:, None]
    )
    assert torch.equal(sample(logits, sampling, bitmask), result.tokens[:, 0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_never_emits_a_forbidden_token_and_marks_dead_ends(temperature):
    rows, vocab_size = 500, 70
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab_size, generator=generator) * 4
    allowed = random_allowed(generator, (rows, vocab_size), density=0.05)
    allowed[::7] = False  # dead ends
    tokens = sample(
        logits, SamplingTensors.full(rows, temperature=temperature, seed=torch.arange(rows)), pack_bitmask(allowed)
    )
    dead = ~allowed.any(-1)
    assert (tokens[dead] == PLACEHOLDER_TOKEN_ID).all()
    live = tokens[~dead]
    assert allowed[~dead].gather(-1, live[:, None]).all()


def test_sample_accepts_half_precision_logits():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.bfloat16, torch.float16):
        expected = logits.to(dtype).float().argmax(-1)
        assert torch.equal(sample(logits.to(dtype)), expected)


@given(st.integers(1, 4), st.integers(1, 40), st.integers(0, 2**31 - 1), st.booleans())
@settings(max_examples=200)
def test_argmax_is_torchs_first_maximum_ties_infinities_and_strides_included(rows, vocab_size, seed, strided):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 2, (rows, 3, vocab_size), generator=generator).float()  # ties everywhere
    logits[0, 0] = float("-inf")
    logits[-1, -1, torch.randint(vocab_size, (1,), generator=generator)] = float("nan")
    if strided:
        logits = logits.transpose(0, 1)
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


def test_argmax_of_other_dtypes_is_torchs():
    logits = torch.tensor([[0.5, 2.0, 2.0], [1.0, -1.0, 0.0]], dtype=torch.bfloat16)
    assert argmax(logits).tolist() == [1, 0]
