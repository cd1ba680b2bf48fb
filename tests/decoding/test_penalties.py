"""Logit bias and penalties (tandem.decoding.penalties): each verify position equals the same rules applied
one position at a time to the output it conditions on, HF's repetition penalty agrees, and neutral rows
are left alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from tandem.decoding.params import SamplingParams
from tandem.decoding.penalties import LogitAdjustments

VOCAB = 12


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One position ``logits [V]`` after ``output`` (module docstring's rules, a token at a time)."""
    logits = logits.clone()
    for token, value in (params.logit_bias or {}).items():
        logits[token] += value
    for token in range(len(logits)):
        count = output.count(token)
        if count or token in prompt:
            r = params.repetition_penalty
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
        logits[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return logits


row_params = st.builds(
    SamplingParams,
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -0.7, 2.0]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    logit_bias=st.none()
    | st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, -2.5, 3.0, 4]), max_size=3),
)
token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=8)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(row_params, token_lists, token_lists, st.lists(st.integers(-1, VOCAB - 1), min_size=3, max_size=3)),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**16),
)
def test_every_position_counts_the_output_and_the_drafts_before_it(rows, seed):
    params, prompts, outputs, drafts = (list(column) for column in zip(*rows))
    drafts = [d[: d.index(-1)] + [-1] * (3 - d.index(-1)) if -1 in d else d for d in drafts]  # -1 pads the end
    logits = torch.randn(len(rows), 4, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    adjusted = LogitAdjustments.build(params, prompts, outputs, VOCAB).apply(logits, torch.tensor(drafts))
    for b in range(len(rows)):
        for j in range(4):
            before = outputs[b] + [d for d in drafts[b][:j] if d >= 0]
            torch.testing.assert_close(
                adjusted[b, j], reference(logits[b, j], params[b], prompts[b], before), rtol=1e-6, atol=1e-5
            )


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(row_params, token_lists, token_lists), min_size=1, max_size=4),
    proposed=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_a_draft_position_counts_the_output_and_the_proposals_before_it(rows, proposed, seed):
    """``apply_after``: what a chaining draft chooses from equals the verify position it proposes for."""
    params, prompts, outputs = (list(column) for column in zip(*rows))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB, generator=g) * 3
    tokens = torch.randint(VOCAB, (len(rows), proposed), generator=g)
    adjusted = LogitAdjustments.build(params, prompts, outputs, VOCAB).apply_after(logits, tokens)
    for b in range(len(rows)):
        expected = reference(logits[b], params[b], prompts[b], outputs[b] + tokens[b].tolist())
        torch.testing.assert_close(adjusted[b], expected, rtol=1e-6, atol=1e-5)


def test_repetition_penalty_agrees_with_transformers():
    generator = torch.Generator().manual_seed(0)
    logits, prompt, output = torch.randn(1, 1, 64, generator=generator) * 4, [3, 5, 5, 9], [9, 12, 40]
    ours = LogitAdjustments.build([SamplingParams(repetition_penalty=1.7)], [prompt], [output], 64).apply(
        logits, torch.empty(1, 0, dtype=torch.int64)
    )
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[:, 0].clone())
    torch.testing.assert_close(ours[:, 0], hf, rtol=0, atol=0)


def test_rows_without_adjustments_keep_their_values_beside_rows_with_them():
    logits = torch.randn(3, 5, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0, logit_bias={2: 5.0}), SamplingParams()]
    drafts = torch.tensor([[1, 1, 2, 2], [1, 1, 2, -1], [3, -1, -1, -1]])
    adjusted = LogitAdjustments.build(params, [[1, 2]] * 3, [[1, 1, 4]] * 3, VOCAB).apply(logits, drafts)
    assert torch.equal(adjusted[0], logits[0]) and torch.equal(adjusted[2], logits[2])
    assert not torch.equal(adjusted[1], logits[1])


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0.0),
        ("logit_bias", {5: 101}),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_out_of_range_settings_are_named(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})
