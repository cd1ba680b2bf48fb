"""Properties of the speculative mask walk and commit, for every backend (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.bitmask import unpack_bitmask
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID
from tandem.grammars.backends import BACKENDS
from tandem.grammars.masks import MaskWalk, SpeculativeMasker
from tandem.grammars.spec import GrammarSpec
from tests.grammars.conftest import PERSON_SCHEMA, PERSON_TEXTS, fresh_mask

MAX_K = 5


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def grammar(request, tokenizer):
    """(new_matcher, token sequences the grammar accepts, each ending with EOS)."""
    new_matcher = BACKENDS[request.param].compile(GrammarSpec.json_schema(PERSON_SCHEMA), tokenizer)
    texts = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in PERSON_TEXTS]
    return new_matcher, texts


@st.composite
def committed_and_drafts(draw, vocab_size):
    """A valid committed prefix, then k drafts: the true continuation with optional corruption."""
    text = draw(st.integers(0, 2))
    split = draw(st.integers(0, 12))
    k = draw(st.integers(0, MAX_K))
    corrupt_at = draw(st.one_of(st.none(), st.integers(0, MAX_K - 1)))
    junk = draw(st.integers(0, vocab_size - 1))
    return text, split, k, corrupt_at, junk


def make_case(texts, text, split, k, corrupt_at, junk):
    tokens = texts[text]
    split = min(split, len(tokens) - 1)
    drafts = tokens[split : split + k]
    drafts += [junk] * (k - len(drafts))
    if corrupt_at is not None and corrupt_at < k:
        drafts[corrupt_at] = junk
    return tokens[:split], drafts


def draw_case(grammar, tokenizer, data):
    """One hypothesis example: (new_matcher, committed, drafts, a fresh masker)."""
    new_matcher, texts = grammar
    committed, drafts = make_case(texts, *data.draw(committed_and_drafts(tokenizer.vocab_size)))
    return new_matcher, committed, drafts, SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))


def walk(masker, tokenizer, committed, drafts, new_matcher):
    masker.add_row("r", new_matcher())
    masker.commit("r", committed)
    k = len(drafts)
    bitmask = torch.zeros(1, k + 1, masker.width, dtype=torch.int32)
    in_thinking = torch.zeros(1, k + 1, dtype=torch.bool)
    masker.fill(["r"], torch.tensor([drafts], dtype=torch.int64).view(1, k), bitmask, in_thinking)
    return bitmask[0]


@settings(max_examples=40)
@given(data=st.data())
def test_mask_row_i_equals_fresh_matcher_fed_prefix(grammar, tokenizer, data):
    new_matcher, committed, drafts, masker = draw_case(grammar, tokenizer, data)
    rows = walk(masker, tokenizer, committed, drafts, new_matcher)
    for i in range(len(drafts) + 1):
        assert torch.equal(rows[i], fresh_mask(new_matcher, committed + drafts[:i], masker.width)), f"row {i}"
        if i < len(drafts) and not unpack_bitmask(rows[i], tokenizer.vocab_size)[drafts[i]]:
            assert torch.equal(rows[i + 1 :], masker.base_row.expand_as(rows[i + 1 :])), (
                "rows after a forbidden draft are the base row"
            )
            break


@settings(max_examples=40)
@given(data=st.data())
def test_mask_walk_leaves_matcher_unchanged(grammar, tokenizer, data):
    new_matcher, committed, drafts, masker = draw_case(grammar, tokenizer, data)
    walk(masker, tokenizer, committed, drafts, new_matcher)
    matcher = masker.row("r").matcher
    out = torch.zeros(1, masker.width, dtype=torch.int32)
    matcher.fill_bitmask(out, 0)
    assert torch.equal(out[0], fresh_mask(new_matcher, committed, masker.width))
    assert matcher.is_terminated() == (bool(committed) and committed[-1] == tokenizer.eos_token_id)


@settings(max_examples=30)
@given(data=st.data())
def test_a_step_by_step_walk_offers_row_i_before_token_i(grammar, tokenizer, data):
    """Grammar-aware drafting reads row i, picks token i, advances: the rows are `fill`'s."""
    new_matcher, committed, drafts, masker = draw_case(grammar, tokenizer, data)
    expected = walk(masker, tokenizer, committed, drafts, new_matcher)
    k = len(drafts)
    stepper = MaskWalk(
        masker,
        ["r"],
        k,
        torch.zeros(1, k + 1, masker.width, dtype=torch.int32),
        torch.zeros(1, k + 1, dtype=torch.bool),
    )
    for i in range(k + 1):
        assert torch.equal(stepper.allowed()[0], unpack_bitmask(expected[i], tokenizer.vocab_size)), f"row {i}"
        if i < k:
            stepper.advance(torch.tensor([drafts[i]]))
    with pytest.raises(RuntimeError, match="past its k"):
        stepper.advance([0])
    stepper.finish()
    out = torch.zeros(1, masker.width, dtype=torch.int32)
    masker.row("r").matcher.fill_bitmask(out, 0)
    assert torch.equal(out[0], fresh_mask(new_matcher, committed, masker.width)), "finish rolls the walk back"


def test_a_terminated_matcher_refuses_every_token_quietly(grammar, tokenizer, capfd):
    """Walks probe drafts past an accepted EOS: refused, state unchanged, nothing logged."""
    new_matcher, texts = grammar
    matcher = new_matcher()
    for token in texts[0]:
        assert matcher.accept_token(token)
    capfd.readouterr()
    assert not any(matcher.accept_token(token) for token in (0, texts[0][0], tokenizer.eos_token_id))
    assert matcher.is_terminated()
    assert capfd.readouterr() == ("", "")


@settings(max_examples=40)
@given(data=st.data(), rollback=st.integers(0, MAX_K))
def test_rollback_restores_exact_state(grammar, tokenizer, data, rollback):
    new_matcher, texts = grammar
    tokens = texts[data.draw(st.integers(0, 2))]
    split = data.draw(st.integers(0, len(tokens)))
    rollback = min(rollback, split)
    matcher = new_matcher()
    for token in tokens[:split]:
        assert matcher.accept_token(token)
    matcher.rollback(rollback)
    width = (tokenizer.vocab_size + 31) // 32
    out = torch.zeros(1, width, dtype=torch.int32)
    matcher.fill_bitmask(out, 0)
    assert torch.equal(out[0], fresh_mask(new_matcher, tokens[: split - rollback], width))
    for token in tokens[split - rollback :]:  # and it walks on exactly like a fresh one
        assert matcher.accept_token(token)
    assert matcher.is_terminated()


@settings(max_examples=40)
@given(data=st.data(), num_accepted=st.integers(0, MAX_K))
def test_commit_after_any_acceptance_equals_direct_feed(grammar, tokenizer, data, num_accepted):
    new_matcher, committed, drafts, masker = draw_case(grammar, tokenizer, data)
    rows = walk(masker, tokenizer, committed, drafts, new_matcher)
    num_accepted = min(num_accepted, len(drafts))
    allowed = unpack_bitmask(rows, tokenizer.vocab_size)
    # The acceptance core only accepts allowed drafts and emits an allowed token: mimic it.
    while (
        num_accepted and not allowed[:num_accepted, :].gather(1, torch.tensor(drafts[:num_accepted]).view(-1, 1)).all()
    ):
        num_accepted -= 1
    bonus_choices = allowed[num_accepted].nonzero().flatten().tolist()
    if not bonus_choices:
        return  # grammar finished: nothing may be emitted
    bonus = data.draw(st.sampled_from(bonus_choices))
    step = drafts[:num_accepted] + [bonus]
    masker.commit("r", step)
    out = torch.zeros(1, masker.width, dtype=torch.int32)
    masker.row("r").matcher.fill_bitmask(out, 0)
    assert torch.equal(out[0], fresh_mask(new_matcher, committed + step, masker.width))


def test_ids_past_the_tokenizer_and_special_tokens_are_never_allowed(grammar, tokenizer):
    new_matcher, texts = grammar
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    specials = [i for i in tokenizer.hf.all_special_ids if i != tokenizer.eos_token_id]
    for tokens in texts:
        for split in range(len(tokens)):
            allowed = unpack_bitmask(fresh_mask(new_matcher, tokens[:split], masker.width), tokenizer.vocab_size)
            assert not allowed[len(tokenizer.hf) :].any()
            assert not allowed[specials].any()
    assert not unpack_bitmask(masker.base_row, tokenizer.vocab_size)[len(tokenizer.hf) :].any()


def test_plain_step_k0_and_rows_without_grammar(grammar, tokenizer):
    new_matcher, texts = grammar
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    masker.add_row("g", new_matcher())
    masker.add_row("free", None)
    bitmask = torch.zeros(2, 1, masker.width, dtype=torch.int32)
    in_thinking = torch.ones(2, 1, dtype=torch.bool)
    nothing = masker.fill(["free", "g"], torch.zeros(2, 0, dtype=torch.int64), bitmask, in_thinking)
    assert torch.equal(bitmask[0, 0], masker.base_row)
    assert torch.equal(bitmask[1, 0], fresh_mask(new_matcher, [], masker.width))
    assert not in_thinking.any() and not nothing.any()


def test_grammar_allowing_nothing_is_reported(grammar, tokenizer):
    new_matcher, texts = grammar
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    masker.add_row("done", new_matcher())
    masker.commit("done", texts[0])  # ends with EOS: the grammar is complete
    assert masker.is_terminated("done")
    bitmask = torch.zeros(1, 1, masker.width, dtype=torch.int32)
    nothing = masker.fill(["done"], torch.zeros(1, 0, dtype=torch.int64), bitmask, torch.zeros(1, 1, dtype=torch.bool))
    assert nothing.tolist() == [[True]]


def test_commit_of_a_forbidden_token_raises(grammar, tokenizer):
    new_matcher, _ = grammar
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    masker.add_row("r", new_matcher())
    with pytest.raises(RuntimeError, match="row 'r': committed token .* forbidden"):
        masker.commit("r", tokenizer.encode("]"))


def test_fill_rejects_a_buffer_of_the_wrong_shape(tokenizer):
    masker = SpeculativeMasker(tokenizer.vocab_size)
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[B, 3,"):
        masker.fill(
            [],
            torch.zeros(0, 2, dtype=torch.int64),
            torch.zeros(1, 2, masker.width, dtype=torch.int32),
            torch.zeros(1, 3, dtype=torch.bool),
        )


@pytest.mark.parametrize("device", ["meta", "cuda"][: 1 + torch.cuda.is_available()])
def test_fill_rejects_a_device_buffer_instead_of_writing_through_its_pointer(tokenizer, device):
    masker = SpeculativeMasker(tokenizer.vocab_size)
    bitmask = torch.zeros(1, 3, masker.width, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=f"bitmask must be a contiguous CPU tensor .*, got {device}"):
        masker.fill([], torch.zeros(0, 2, dtype=torch.int64), bitmask, torch.zeros(1, 3, dtype=torch.bool))


def test_fill_rejects_a_strided_bitmask_its_rows_could_not_be_written_through(tokenizer):
    masker = SpeculativeMasker(tokenizer.vocab_size)
    strided = torch.zeros(1, masker.width, 3, dtype=torch.int32).transpose(1, 2)  # [1, 3, W], not contiguous
    with pytest.raises(ValueError, match=r"got cpu \(contiguous: False\)"):
        masker.fill([], torch.zeros(0, 2, dtype=torch.int64), strided, torch.zeros(1, 3, dtype=torch.bool))


def test_placeholder_padded_drafts_end_the_walk_like_a_forbidden_draft(grammar, tokenizer):
    """A row with fewer drafts than k (an n-gram miss) is padded with PLACEHOLDER_TOKEN_ID."""
    new_matcher, texts = grammar
    masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
    first = texts[0][0]
    rows = walk(masker, tokenizer, [], [first, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID], new_matcher)
    assert torch.equal(rows[0], fresh_mask(new_matcher, [], masker.width))
    assert torch.equal(rows[1], fresh_mask(new_matcher, [first], masker.width))
    assert torch.equal(rows[2:], masker.base_row.expand_as(rows[2:]))
    assert torch.equal(_current_mask(masker, "r"), fresh_mask(new_matcher, [], masker.width))


def _current_mask(masker, row_id):
    out = torch.zeros(1, masker.width, dtype=torch.int32)
    masker.row(row_id).matcher.fill_bitmask(out, 0)
    return out[0]
