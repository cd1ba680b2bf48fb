"""The lossless rule: emitted tokens are distributed exactly as sampling from the target."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.bitmask import pack_bitmask
from tandem.decoding import SamplingTensors, accept, sample

from .reference import assert_distributed_as, assert_rate, reference_probs
from .strategies import filter_settings, random_allowed

ROWS = 20_000  # rows per example: one draw each, all sharing the example's distributions


@st.composite
def speculative_case(draw):
    """Target logits, draft distributions and drafts for ROWS rows of one synthetic step."""
    vocab_size = draw(st.integers(2, 32))
    k = draw(st.integers(1, 5))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(k + 1, vocab_size, generator=generator) * 1.5
    allowed = random_allowed(generator, (k + 1, vocab_size)) if draw(st.booleans()) else None
    with_draft_probs = draw(st.booleans())
    if with_draft_probs:
        q = (torch.randn(k, vocab_size, generator=generator) * 1.5).softmax(-1)
        drafts = torch.multinomial(q, ROWS, replacement=True, generator=generator).T  # [ROWS, k]
    else:
        # Deterministic drafts may be any token, likely or not, allowed or not.
        q = None
        drafts = torch.randint(vocab_size, (ROWS, k), generator=generator)
        favourite = logits[:k].argmax(-1)
        drafts = torch.where(torch.rand(ROWS, k, generator=generator) < 0.5, favourite, drafts)
    return logits, allowed, q, drafts, draw(filter_settings(vocab_size))


def _run(logits, allowed, q, drafts, settings_):
    k = drafts.shape[1]
    bitmask = None if allowed is None else pack_bitmask(allowed).expand(ROWS, -1, -1).contiguous()
    draft_probs = None if q is None else q.expand(ROWS, -1, -1)
    sampling = SamplingTensors.full(ROWS, seed=torch.arange(ROWS) * 7919 + k, **settings_)
    return accept(logits.expand(ROWS, -1, -1), drafts, draft_probs=draft_probs, sampling=sampling, bitmask=bitmask)


def _p(logits, allowed, j, settings_):
    return reference_probs(logits[j], None if allowed is None else allowed[j], **settings_)


@given(speculative_case())
@settings(max_examples=25)
def test_first_emitted_token_is_distributed_as_p0(case):
    logits, allowed, q, drafts, settings_ = case
    result = _run(*case)
    assert_distributed_as(result.tokens[:, 0], _p(logits, allowed, 0, settings_), f"first token {settings_}")


@given(speculative_case())
@settings(max_examples=25)
def test_second_emitted_token_given_draft0_accepted_is_distributed_as_p1(case):
    logits, allowed, q, drafts, settings_ = case
    result = _run(*case)
    rows = result.num_accepted >= 1
    if rows.sum() < 1000:  # too few acceptances to test this example with power
        return
    assert_distributed_as(result.tokens[rows, 1], _p(logits, allowed, 1, settings_), f"second token {settings_}")


@given(speculative_case())
@settings(max_examples=25)
def test_acceptance_rate_of_draft0_is_sum_of_min_p_q(case):
    logits, allowed, q, drafts, settings_ = case
    result = _run(*case)
    p0 = _p(logits, allowed, 0, settings_)
    if q is None:
        # q is the point mass at the row's draft: P(accept | d) = min(1, p(d) / 1) = p(d).
        expected = float(np.mean(p0[drafts[:, 0].numpy()]))
    else:
        expected = float(np.minimum(p0, q[0].double().numpy()).sum())
    assert_rate(int((result.num_accepted >= 1).sum()), ROWS, expected, f"acceptance of draft 0 {settings_}")


def test_all_drafts_accepted_emits_a_bonus_from_pk():
    vocab_size, k = 12, 3
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(k + 1, vocab_size, generator=generator)
    logits[:k, 3] = 30.0  # the target is sure of token 3 at every draft position
    drafts = torch.full((ROWS, k), 3)
    result = accept(logits.expand(ROWS, -1, -1), drafts, sampling=SamplingTensors.full(ROWS, seed=torch.arange(ROWS)))
    assert (result.num_accepted == k).all()
    assert_distributed_as(result.tokens[:, k], reference_probs(logits[k]), "bonus token")


def test_a_forbidden_draft_is_always_rejected_and_emitted_tokens_are_allowed():
    vocab_size, k, rows = 20, 4, 4000
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(rows, k + 1, vocab_size, generator=generator)
    allowed = random_allowed(generator, (rows, k + 1, vocab_size), density=0.3)
    q = torch.randn(rows, k, vocab_size, generator=generator).softmax(-1)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(rows, k)
    result = accept(
        logits,
        drafts,
        draft_probs=q,
        bitmask=pack_bitmask(allowed),
        sampling=SamplingTensors.full(rows, seed=torch.arange(rows)),
    )
    draft_allowed = allowed[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    positions = torch.arange(k)
    accepted = positions < result.num_accepted[:, None]
    assert draft_allowed[accepted].all()
    emitted = result.tokens.gather(1, result.num_accepted[:, None])
    assert (
        allowed.gather(1, result.num_accepted[:, None, None].expand(-1, 1, vocab_size))
        .squeeze(1)
        .gather(-1, emitted)
        .all()
    )


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_a_row_padded_with_placeholder_drafts_is_a_plain_sampling_step(with_draft_probs):
    vocab_size, k = 10, 3
    generator = torch.Generator().manual_seed(13)
    logits = torch.randn(ROWS, k + 1, vocab_size, generator=generator)
    q = torch.randn(ROWS, k, vocab_size, generator=generator).softmax(-1) if with_draft_probs else None
    sampling = SamplingTensors.full(ROWS, seed=torch.arange(ROWS), top_p=0.9)
    padded = accept(logits, torch.full((ROWS, k), -1), draft_probs=q, sampling=sampling)
    assert (padded.num_accepted == 0).all()
    assert torch.equal(padded.tokens[:, 0], sample(logits[:, 0], sampling))
