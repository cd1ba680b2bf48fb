"""llguidance's forced runs (backends/llguidance.py): a run's states are masked from the run kept at its
start, with no call to llguidance, and every mask stays the one llguidance computes for that state."""

from __future__ import annotations

import pytest
import torch

from tandem.core.bitmask import bitmask_width
from tandem.grammars.backends import llguidance
from tandem.grammars.spec import GrammarSpec

# Long declared keys and a constant: forced runs of several tokens between free values.
SCHEMA = {
    "type": "object",
    "properties": {
        "description_of_the_item": {"type": "string", "maxLength": 8},
        "kind": {"const": "answer_with_a_constant"},
        "count": {"type": "integer"},
    },
    "required": ["description_of_the_item", "kind", "count"],
    "additionalProperties": False,
}
TEXT = '{"description_of_the_item":"ok","kind":"answer_with_a_constant","count":42}'


class CountingMatcher:
    """An llguidance.LLMatcher that counts the calls that compute a mask or a forced run."""

    def __init__(self, matcher):
        self.matcher, self.calls = matcher, 0

    def unsafe_compute_mask_ptr(self, *args):
        self.calls += 1
        return self.matcher.unsafe_compute_mask_ptr(*args)

    def compute_ff_tokens(self):
        self.calls += 1
        return self.matcher.compute_ff_tokens()

    def __getattr__(self, name):
        return getattr(self.matcher, name)


@pytest.fixture(scope="module")
def new_matcher(tokenizer):
    return llguidance.compile(GrammarSpec.json_schema(SCHEMA, whitespace="compact"), tokenizer)


def llguidance_mask(new_matcher, tokens, width):
    """llguidance's own mask after `tokens`, from a fresh LLMatcher: int32 [W]."""
    raw = new_matcher()._matcher
    assert raw.try_consume_tokens(tokens) == len(tokens)
    row = torch.zeros(1, width, dtype=torch.int32)
    raw.unsafe_compute_mask_ptr(row.data_ptr(), row.nbytes)
    return row[0]


def walk(matcher, tokens, width):
    """Fill then take each token; returns the masks, int32 [len(tokens), W]."""
    masks = torch.zeros(len(tokens), width, dtype=torch.int32)
    for i, token in enumerate(tokens):
        matcher.fill_bitmask(masks, i)
        assert matcher.accept_token(token), f"token {i} refused"
    return masks


def test_a_forced_run_is_masked_without_llguidance_and_as_llguidance_masks_it(new_matcher, tokenizer):
    width = bitmask_width(tokenizer.vocab_size)
    tokens = tokenizer.encode(TEXT)
    matcher = new_matcher()
    matcher._matcher = counting = CountingMatcher(matcher._matcher)
    masks = walk(matcher, tokens, width)
    singles = sum(int(torch.count_nonzero(row)) == 1 for row in masks)
    assert singles >= 10, "the schema should force runs of several tokens"
    assert counting.calls < len(tokens) - singles // 2, "a run's later states should need no call"
    for i in range(len(tokens)):
        assert torch.equal(masks[i], llguidance_mask(new_matcher, tokens[:i], width)), f"position {i}"


def test_a_token_that_leaves_the_run_gets_llguidance_masks_again(new_matcher, tokenizer):
    """A non-canonical split of a forced key (llguidance accepts its bytes): the states after it are
    not the run's, and their masks are llguidance's for those tokens."""
    width = bitmask_width(tokenizer.vocab_size)
    prefix, key = tokenizer.encode('{"'), tokenizer.encode("description_of_the_item")
    split = [t for part in ("d", "escription_of_the_item") for t in tokenizer.encode(part)]
    assert split != key
    rest = tokenizer.encode('":"ok","kind":"answer_with_a_constant","count":42}')
    tokens = prefix + split + rest
    masks = walk(new_matcher(), tokens, width)
    for i in range(len(prefix) + 1, len(tokens)):
        assert torch.equal(masks[i], llguidance_mask(new_matcher, tokens[:i], width)), f"position {i}"


@pytest.mark.parametrize("back", [1, 3])
def test_rollback_into_and_past_a_run_keeps_every_mask_llguidance_s(new_matcher, tokenizer, back):
    """From every position (inside runs, at their ends, in free values): roll back, then walk to the end."""
    width = bitmask_width(tokenizer.vocab_size)
    tokens = tokenizer.encode(TEXT)
    reference = [llguidance_mask(new_matcher, tokens[:i], width) for i in range(len(tokens))]
    for stop in range(back, len(tokens)):
        matcher = new_matcher()
        walk(matcher, tokens[:stop], width)
        matcher.rollback(back)
        masks = walk(matcher, tokens[stop - back :], width)
        for i in range(stop - back, len(tokens)):
            assert torch.equal(masks[i - stop + back], reference[i]), f"rolled back from {stop}, position {i}"


def test_tokens_taken_without_fills_give_the_masks_of_a_filled_walk(new_matcher, tokenizer):
    """A state's run follows from its parent's, so a matcher fed tokens directly masks as one that filled
    every state on the way (the masker's commit takes tokens without fills)."""
    width = bitmask_width(tokenizer.vocab_size)
    tokens = tokenizer.encode(TEXT)
    filled = walk(new_matcher(), tokens, width)
    for i in range(len(tokens)):
        matcher = new_matcher()
        assert all(matcher.accept_token(t) for t in tokens[:i])
        row = torch.zeros(1, width, dtype=torch.int32)
        matcher.fill_bitmask(row, 0)
        assert torch.equal(row[0], filled[i]), f"position {i}"


def test_tokens_taken_again_after_a_rollback_need_no_call(new_matcher, tokenizer):
    """The masker's pattern: walk the drafts, roll back, commit the same tokens, walk on."""
    width = bitmask_width(tokenizer.vocab_size)
    tokens = tokenizer.encode(TEXT)
    matcher = new_matcher()
    matcher._matcher = counting = CountingMatcher(matcher._matcher)
    walk(matcher, tokens[:20], width)
    matcher.rollback(20)
    calls = counting.calls
    assert all(matcher.accept_token(t) for t in tokens[:20])
    assert counting.calls == calls
    masks = walk(matcher, tokens[20:], width)
    for i in range(20, len(tokens)):
        assert torch.equal(masks[i - 20], llguidance_mask(new_matcher, tokens[:i], width)), f"position {i}"


def test_another_path_after_a_rollback_gets_its_own_masks(new_matcher, tokenizer):
    """Rolled back out of a forced key, the matcher takes a non-canonical split of it instead, then the
    canonical one again: each path's masks are llguidance's."""
    width = bitmask_width(tokenizer.vocab_size)
    prefix, rest = tokenizer.encode('{"'), tokenizer.encode('":"ok","kind":"answer_with_a_constant","count":42}')
    canonical = prefix + tokenizer.encode("description_of_the_item") + rest
    split = prefix + [t for part in ("d", "escription_of_the_item") for t in tokenizer.encode(part)] + rest
    matcher = new_matcher()
    for tokens, back in ((canonical, len(canonical) - len(prefix)), (split, len(split) - len(prefix)), (canonical, 0)):
        masks = walk(matcher, tokens[len(prefix) :], width) if matcher._taken else walk(matcher, tokens, width)
        start = len(tokens) - len(masks)
        for i in range(start, len(tokens)):
            assert torch.equal(masks[i - start], llguidance_mask(new_matcher, tokens[:i], width)), f"position {i}"
        matcher.rollback(back)


def test_a_token_taken_again_from_another_state_gets_that_state_s_run(tokenizer):
    """`a` forces another text after `b` than at the start: rolled back from `a` and then taking `b` and
    `a`, the matcher must not reuse the run it undid."""
    width = bitmask_width(tokenizer.vocab_size)
    new_matcher = llguidance.compile(GrammarSpec.regex("a the first forced text|ba another forced one"), tokenizer)
    a, b = tokenizer.encode("a"), tokenizer.encode("b")
    matcher = new_matcher()
    walk(matcher, a, width)
    row = torch.zeros(1, width, dtype=torch.int32)
    matcher.fill_bitmask(row, 0)  # forced: the run after `a` is found, then undone
    assert int(torch.count_nonzero(row)) == 1
    matcher.rollback(1)
    tokens = b + a + tokenizer.encode(" another forced one")
    masks = walk(matcher, tokens, width)
    for i in range(len(tokens)):
        assert torch.equal(masks[i], llguidance_mask(new_matcher, tokens[:i], width)), f"position {i}"
