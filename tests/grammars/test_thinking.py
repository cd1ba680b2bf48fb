"""ThinkingTracker, alone and inside the masker; one regression test per failure mode vLLM shipped."""

from __future__ import annotations

import pytest
import torch

from tandem.core.bitmask import unpack_bitmask
from tandem.grammars.backends import BACKENDS
from tandem.grammars.masks import SpeculativeMasker
from tandem.grammars.spec import GrammarSpec
from tandem.thinking import ThinkingMarkers, ThinkingTracker
from tests.grammars.conftest import PERSON_SCHEMA, PERSON_TEXTS, fresh_mask


@pytest.fixture(scope="module")
def markers(hf_tokenizer):
    return ThinkingMarkers.from_tokenizer(hf_tokenizer)


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def new_matcher(request, tokenizer):
    return BACKENDS[request.param].compile(GrammarSpec.json_schema(PERSON_SCHEMA), tokenizer)


def step(masker, drafts):
    k = len(drafts)
    bitmask = torch.zeros(1, k + 1, masker.width, dtype=torch.int32)
    in_thinking = torch.zeros(1, k + 1, dtype=torch.bool)
    masker.fill(["r"], torch.tensor([drafts], dtype=torch.int64).view(1, k), bitmask, in_thinking)
    return bitmask[0], in_thinking[0].tolist()


def test_markers_come_from_the_tokenizer(hf_tokenizer, markers):
    assert markers.open_id == hf_tokenizer.convert_tokens_to_ids("<think>")
    assert markers.close_id == hf_tokenizer.convert_tokens_to_ids("</think>")
    with pytest.raises(ValueError, match="no single token for '<reason>'"):
        ThinkingMarkers.from_tokenizer(hf_tokenizer, open_text="<reason>")


def test_start_state_comes_from_the_prompt(tokenizer, markers):
    text = tokenizer.encode("{}")
    assert ThinkingTracker(markers, text + [markers.open_id] + text).thinking  # chat template opened <think>
    assert not ThinkingTracker(markers, [markers.open_id] + text + [markers.close_id]).thinking
    assert not ThinkingTracker(markers, text).thinking
    assert ThinkingTracker(markers, text, expect_reasoning=True).thinking  # the model opens <think> itself


def test_phases_do_not_change_state(markers):
    tracker = ThinkingTracker(markers, [markers.open_id])
    assert tracker.phases([5, markers.close_id, 6]) == [True, True, False, False]
    assert tracker.thinking


def test_constraint_applied_after_mid_window_think_end(new_matcher, tokenizer, markers):
    """vLLM bug: a `</think>` inside the draft window left the grammar off for the rest of the step."""
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    masker.add_row("r", new_matcher(), ThinkingTracker(markers, [markers.open_id]))
    answer = tokenizer.encode(PERSON_TEXTS[0])
    drafts = tokenizer.encode(" so") + [markers.close_id] + answer[:2]
    j = drafts.index(markers.close_id)
    rows, in_thinking = step(masker, drafts)
    assert in_thinking == [True] * (j + 1) + [False] * (len(drafts) - j)
    for i in range(j + 1):
        assert torch.equal(rows[i], masker.base_row)
    for i in range(j + 1, len(drafts) + 1):
        assert torch.equal(rows[i], fresh_mask(new_matcher, drafts[j + 1 : i], masker.width)), f"row {i}"
        assert not torch.equal(rows[i], masker.base_row)


def test_tokens_after_think_end_reach_grammar(new_matcher, tokenizer, markers):
    """vLLM bug: tokens committed in the same step as `</think>` never reached the grammar."""
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    masker.add_row("r", new_matcher(), ThinkingTracker(markers, [markers.open_id]))
    answer = tokenizer.encode(PERSON_TEXTS[0])
    masker.commit("r", tokenizer.encode(" ok") + [markers.close_id] + answer[:3])
    rows, in_thinking = step(masker, [])
    assert in_thinking == [False]
    assert torch.equal(rows[0], fresh_mask(new_matcher, answer[:3], masker.width))


def test_think_end_marker_never_fed_to_grammar(new_matcher, tokenizer, markers):
    """vLLM bug: the `</think>` marker itself (and reasoning before it) was fed into the grammar."""
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    masker.add_row("r", new_matcher(), ThinkingTracker(markers, [markers.open_id]))
    reasoning = tokenizer.encode("] not json [")  # forbidden by the grammar: feeding it would raise
    masker.commit("r", reasoning + [markers.close_id])
    rows, _ = step(masker, [])
    assert torch.equal(rows[0], fresh_mask(new_matcher, [], masker.width))
    # and in a draft window: a walk through reasoning + marker leaves the grammar at its start
    masker2 = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    masker2.add_row("r", new_matcher(), ThinkingTracker(markers, [markers.open_id]))
    rows, _ = step(masker2, reasoning + [markers.close_id])
    assert torch.equal(rows[-1], fresh_mask(new_matcher, [], masker.width))


def test_rows_in_thinking_get_the_base_row_and_leave_the_matcher_alone(new_matcher, tokenizer, markers):
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    masker.add_row("r", new_matcher(), ThinkingTracker(markers, [markers.open_id]))
    rows, in_thinking = step(masker, tokenizer.encode("] [ ]"))
    assert all(in_thinking)
    assert torch.equal(rows, masker.base_row.expand_as(rows))


def test_a_constrained_row_cannot_end_while_thinking(new_matcher, tokenizer, markers):
    """EOS inside `<think>` would end a schema request with no answer: thinking rows forbid it."""
    eos = tokenizer.eos_token_id
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf), end_token_ids=[eos])
    masker.add_row("r", new_matcher(), ThinkingTracker(markers, [markers.open_id]))
    masker.add_row("free", None, ThinkingTracker(markers, [markers.open_id]))
    drafts = tokenizer.encode(" so") + [markers.close_id]
    bitmask = torch.zeros(2, len(drafts) + 1, masker.width, dtype=torch.int32)
    masker.fill(
        ["r", "free"], torch.tensor([drafts, drafts]), bitmask, torch.zeros(2, len(drafts) + 1, dtype=torch.bool)
    )
    allowed = unpack_bitmask(bitmask, tokenizer.vocab_size)  # [2, k+1, V]
    assert not allowed[0, : len(drafts), eos].any()  # thinking positions of the constrained row
    assert allowed[0, : len(drafts), markers.close_id].all()  # it can still close its reasoning
    assert allowed[1, :, eos].all()  # a row without a grammar may end whenever it likes
