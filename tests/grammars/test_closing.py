"""Closing masks: witnesses the grammar accepts, masks inside the grammar's, and any walk inside them ends
valid when the budget runs out (JSON schema, regex and EBNF grammars, for the backends that take them)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.core.bitmask import unpack_bitmask
from tandem.grammars.backends import BACKENDS
from tandem.grammars.closing import Closer, closing_token_order
from tandem.grammars.masks import SpeculativeMasker
from tandem.grammars.spec import GrammarSpec
from tandem.thinking import ThinkingMarkers, ThinkingTracker
from tests.grammars.conftest import PERSON_SCHEMA, PERSON_TEXTS

GRAMMARS = {
    "schema": (GrammarSpec.json_schema(PERSON_SCHEMA), PERSON_TEXTS[1]),
    "regex": (GrammarSpec.regex(r"[a-z]{1,8}@[a-z]{2,8}\.(com|org)"), "ada@lovelace.org"),
    "ebnf": (GrammarSpec.ebnf('root ::= "(" root ")" | "x"'), "(((x)))"),
}
CASES = [
    (backend, name)
    for name, (spec, _) in GRAMMARS.items()
    for backend in ("xgrammar", "llguidance")
    if spec.kind in BACKENDS[backend].KINDS
]


@pytest.fixture(scope="module")
def closer(tokenizer):
    return Closer.for_tokenizer(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def grammar(request, tokenizer):
    """(new_matcher, the token ids of a text the grammar accepts)."""
    backend, name = request.param
    spec, text = GRAMMARS[name]
    return BACKENDS[backend].compile(spec, tokenizer), tokenizer.encode(text)


def mask(matcher, width) -> torch.Tensor:
    out = torch.zeros(1, width, dtype=torch.int32)
    matcher.fill_bitmask(out, 0)
    return out[0]


def test_token_order_tries_closing_characters_first(hf_tokenizer):
    texts = ["ab", '"}', " ]", "7", ",", '"', "a"]
    order = closing_token_order(texts)
    assert order[:3] == [5, 1, 2] and order[3] == 4 and order[4] == 3  # `"`, `"}`, ` ]`; `,`; digits; words


def test_a_witness_is_accepted_ends_the_grammar_and_leaves_the_matcher_unchanged(grammar, closer, tokenizer):
    new_matcher, tokens = grammar
    width = (tokenizer.vocab_size + 31) // 32
    for split in range(len(tokens) + 1):
        matcher = new_matcher()
        for token in tokens[:split]:
            assert matcher.accept_token(token)
        before = mask(matcher, width)
        witness = closer.search(matcher, 32)
        assert witness is not None, f"no completion found after {tokens[:split]}"
        assert torch.equal(mask(matcher, width), before)
        for token in witness:
            assert matcher.accept_token(token)
        assert bool(unpack_bitmask(mask(matcher, width), tokenizer.vocab_size)[tokenizer.eos_token_id])


def test_the_witness_of_open_brackets_closes_them_all_and_no_more(tokenizer, closer):
    new_matcher = BACKENDS["xgrammar"].compile(GRAMMARS["ebnf"][0], tokenizer)
    matcher = new_matcher()
    for token in tokenizer.encode("((("):
        assert matcher.accept_token(token)
    text = tokenizer.hf.decode(list(closer.search(matcher, 32)))
    assert text == "x)))"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_walk_inside_the_closing_masks_can_end_when_the_budget_runs_out(grammar, closer, tokenizer, data):
    """Whatever allowed token a row takes at each step, its grammar may end when its last token is spent; every
    closing mask is inside the grammar's own; a quick search's witness is searched again wide before its slack
    falls below the closer's `settle` (so before it could restrict a mask)."""
    new_matcher, _ = grammar
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf), closer=closer)
    shortest = len(closer.search(new_matcher(), 32))
    budget = data.draw(st.integers(shortest, shortest + closer.settle + 10))
    masker.add_row("r", new_matcher())
    plain = new_matcher()  # the same tokens, no closing
    bitmask, in_thinking = torch.zeros(1, 1, masker.width, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.bool)
    for remaining in range(budget, 0, -1):
        masker.fill(["r"], torch.zeros(1, 0, dtype=torch.int64), bitmask, in_thinking, remaining=[remaining])
        closing = unpack_bitmask(bitmask[0, 0], tokenizer.vocab_size)
        grammar_mask = unpack_bitmask(mask(plain, masker.width), tokenizer.vocab_size)
        assert not (closing & ~grammar_mask).any(), "a closing mask allows a token the grammar forbids"
        allowed = closing.nonzero().flatten().tolist()
        assert allowed, f"dead end with {remaining} tokens left"
        token = data.draw(st.sampled_from(allowed))
        if token == tokenizer.eos_token_id:
            return
        masker.commit("r", [token])
        committed = masker.row("r").committed
        if isinstance(committed.witness, tuple) and not committed.settled:
            assert remaining - 1 - len(committed.witness) >= closer.settle, "an unsettled witness near the budget"
        assert plain.accept_token(token)
    assert bool(unpack_bitmask(mask(plain, masker.width), tokenizer.vocab_size)[tokenizer.eos_token_id])


def test_a_fresh_witness_is_quick_only_where_it_leaves_the_slack_to_settle(grammar, closer):
    new_matcher, _ = grammar
    matcher = new_matcher()
    wide = closer.search(matcher, 32)
    budget = len(wide) + closer.settle + 4
    witness, settled = closer.fresh(matcher, budget)
    if settled:  # the quick search found none that leaves the slack
        assert witness == wide
    else:
        assert budget - len(witness) >= closer.settle and closer.ends(matcher, witness)
    assert closer.fresh(matcher, closer.settle) == (closer.search(matcher, closer.settle), True)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_schema_with_room_to_spare_takes_the_quick_witness(tokenizer, closer, backend):
    matcher = BACKENDS[backend].compile(GrammarSpec.json_schema(PERSON_SCHEMA), tokenizer)()
    for token in tokenizer.encode('{"name":"Ad'):
        assert matcher.accept_token(token)
    witness, settled = closer.fresh(matcher, 48)
    assert not settled and len(witness) <= 48 - closer.settle and closer.ends(matcher, witness)


def test_a_budget_too_small_for_any_completion_leaves_the_masks_alone(grammar, closer, tokenizer):
    new_matcher, _ = grammar
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf), closer=closer)
    masker.add_row("r", new_matcher())
    shortest = len(closer.search(new_matcher(), 32))
    if shortest < 2:
        pytest.skip("the grammar ends after one token")
    bitmask, in_thinking = torch.zeros(1, 1, masker.width, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.bool)
    masker.fill(["r"], torch.zeros(1, 0, dtype=torch.int64), bitmask, in_thinking, remaining=[shortest - 1])
    assert torch.equal(bitmask[0, 0], mask(new_matcher(), masker.width))


def test_a_thinking_row_with_room_only_for_the_shortest_answer_must_close_its_reasoning(tokenizer, closer):
    markers = ThinkingMarkers.from_tokenizer(tokenizer.hf)
    new_matcher = BACKENDS["llguidance"].compile(GrammarSpec.json_schema(PERSON_SCHEMA), tokenizer)
    shortest = len(closer.search(new_matcher(), 32))
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf), closer=closer)
    masker.add_row("r", new_matcher(), ThinkingTracker(markers, [markers.open_id]))
    bitmask, in_thinking = torch.zeros(1, 2, masker.width, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.bool)
    think = tokenizer.encode(" hmm")[:1]
    masker.fill(["r"], torch.tensor([think]), bitmask, in_thinking, remaining=[shortest + 2])
    assert in_thinking.all()
    assert unpack_bitmask(bitmask[0, 0], tokenizer.vocab_size).sum() > 1  # one token of slack: free
    assert unpack_bitmask(bitmask[0, 1], tokenizer.vocab_size).nonzero().flatten().tolist() == [markers.close_id]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_witness_follows_a_row_that_writes_its_text_in_other_pieces(tokenizer, closer, backend):
    """Where the row writes the witness's text split otherwise (a shorter or longer piece of the same
    characters), the witness is derived from the text left, not lost to a fresh search: for every token whose
    text starts the witness's and is not its first token, the derived witness is the text that remains."""
    new_matcher = BACKENDS[backend].compile(GrammarSpec.regex(r"(19|20)[0-9]{2}-[0-9]{2}"), tokenizer)
    matcher = new_matcher()
    witness = closer.search(matcher, 16)
    text = tokenizer.hf.decode(list(witness))
    resplit = [
        t for t in range(len(closer.texts)) if closer.texts[t] and text.startswith(closer.texts[t]) and t != witness[0]
    ]
    assert resplit, f"no other split of {text!r} in the tokenizer"
    for token in resplit:
        assert matcher.accept_token(token)
        derived = closer.derive(matcher, witness, token)
        assert isinstance(derived, tuple), f"{closer.texts[token]!r} of {text!r}"
        assert closer.texts[token] + tokenizer.hf.decode(list(derived)) == text
        assert closer.ends(matcher, derived)
        matcher.rollback(1)


def test_rows_of_one_grammar_search_its_start_state_once(grammar, closer, tokenizer, monkeypatch):
    """The start state's witness is the grammar's alone: rows that share their grammar's key search it once, and
    get what rows searching alone get, whatever their budgets (below the witness's length too)."""
    new_matcher, _ = grammar
    shortest = len(closer.search(new_matcher(), 32))
    wide, search = [], closer.search

    def counted(matcher, limit, *narrow):  # the wide searches counted, not the narrow ones proofs run
        wide.extend([] if narrow else [limit])
        return search(matcher, limit, *narrow)

    monkeypatch.setattr(closer, "search", counted)
    shared, alone = (SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf), closer=closer) for _ in range(2))
    bitmask, in_thinking = torch.zeros(1, 1, shared.width, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.bool)
    for row, budget in enumerate([shortest + 6, shortest, shortest + 2, max(shortest - 1, 1), shortest + 9]):
        masks = []
        for masker, key in ((shared, "grammar"), (alone, None)):
            masker.add_row(row, new_matcher(), grammar=key)
            masker.fill([row], torch.zeros(1, 0, dtype=torch.int64), bitmask, in_thinking, remaining=[budget])
            masks.append((bitmask.clone(), masker.row(row).committed.witness))
        assert torch.equal(masks[0][0], masks[1][0]) and masks[0][1] == masks[1][1]
    assert len(wide) == 1 + 5  # the shared rows' one search, then each of the lone rows'
