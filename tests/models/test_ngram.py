"""n-gram prompt lookup: longest suffix match, most recent occurrence, -1 padding."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.models import DraftInput, ForwardBatch, load_draft
from tandem.models.drafts.ngram import NgramDraft, lookup


def t(values):
    return torch.tensor(values, dtype=torch.int64)


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    #        the 3-gram [1, 2, 3] occurred first, then only [2, 3] (followed by 9)
    history = t([1, 2, 3, 4, 5, 6, 7, 2, 3, 9, 1, 2, 3])
    assert lookup(history, 3, 1, 4).tolist() == [4, 5, 6]
    assert lookup(history, 3, 1, 2).tolist() == [9, 1, 2]  # capped at 2-grams: the most recent [2, 3]


def test_a_match_near_the_end_pads_with_minus_one_and_no_match_gives_all_minus_one():
    assert lookup(t([5, 6, 7, 5, 6]), 4, 1, 3).tolist() == [7, 5, 6, -1]
    assert lookup(t([1, 2, 3, 4]), 3, 1, 3).tolist() == [-1, -1, -1]
    assert lookup(t([1, 2, 1, 3, 4, 2]), 2, 2, 3).tolist() == [-1, -1]  # only 1-gram matches, min is 2


def _reference_lookup(history: list[int], num_tokens: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The rule read literally: the longest suffix (max_ngram down to min_ngram) seen earlier, its most recent
    occurrence's next num_tokens ids, -1 padded."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        starts = [i for i in range(len(history) - n) if history[i : i + n] == history[-n:]]
        if starts:
            follow = history[starts[-1] + n : starts[-1] + n + num_tokens]
            return follow + [-1] * (num_tokens - len(follow))
    return [-1] * num_tokens


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 2, 256, 257, 65536, 2**31 + 1]), min_size=1, max_size=40),
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(0, 3),
)
def test_lookup_follows_the_rule_whatever_the_ids_bytes(history, num_tokens, min_ngram, extra):
    """The byte search counts only hits on an id's boundary: ids whose bytes repeat inside others (0, 1, 256,
    65536, ...) would match across two ids otherwise."""
    max_ngram = min_ngram + extra
    assert lookup(t(history), num_tokens, min_ngram, max_ngram).tolist() == _reference_lookup(
        history, num_tokens, min_ngram, max_ngram
    )


def test_propose_handles_each_row_independently(llama_dir):
    from tandem.models import load_target

    draft = load_draft("ngram", load_target(llama_dir))
    assert isinstance(draft, NgramDraft) and draft.hidden_kind is None and draft.new_cache(2, 8) is None
    histories = [t([3, 4, 5, 3, 4]), t([7, 8, 9])]
    batch = ForwardBatch.from_rows([[4], [9]], [4, 2], [0, 1])
    proposal = draft.propose(DraftInput(batch=batch, hidden=None, history=histories), None, 2)
    assert proposal.probs is None
    assert proposal.tokens.tolist() == [[5, 3], [-1, -1]]
