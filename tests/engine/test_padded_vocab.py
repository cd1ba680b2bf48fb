"""A model whose vocabulary is padded past its tokenizer's (issue 30): ids >= len(tokenizer) are never
emitted nor drafted, and a row's tokens do not depend on whether another row in its batch has a grammar."""

import dataclasses

import pytest
import torch

from tandem.decoding.params import SamplingParams
from tandem.engine import Engine, EngineConfig
from tandem.models.base import Draft, DraftProposal

EXTRA = 40  # padded ids past the tokenizer


class PaddedTarget:
    """The tiny target with EXTRA more vocabulary columns whose logits beat every real token's."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size + EXTRA

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, batch, cache, **options):
        out = self.inner.forward(batch, cache, **options)
        top = out.logits.max(dim=-1, keepdim=True).values + 10.0
        ramp = torch.arange(EXTRA, dtype=out.logits.dtype, device=out.logits.device)
        return dataclasses.replace(out, logits=torch.cat([out.logits, top + ramp], dim=-1))


class PaddedDraft(Draft):
    """A grammar-following draft whose own logits favour the padded ids (it proposes below `vocab_limit`)."""

    hidden_kind = None
    follows_constraint = True

    def __init__(self, vocab_size: int, favourite: int) -> None:
        self.vocab_size, self.favourite = vocab_size, favourite
        self.proposed: list[list[int]] = []

    def new_cache(self, num_slots, max_len):
        return None

    def propose(self, inp, cache, num_tokens):
        rows = len(inp.batch.spans.slots)
        tokens = torch.zeros(rows, num_tokens, dtype=torch.int64)
        for i in range(num_tokens):
            logits = torch.zeros(rows, self.vocab_size)
            logits[:, self.favourite] = 1.0
            logits[:, self.vocab_size - EXTRA :] = 5.0
            if inp.adjust is not None:
                logits = inp.adjust(logits, tokens[:, :i])
            if inp.vocab_limit is not None:
                logits[:, inp.vocab_limit :] = float("-inf")
            if inp.constraint is not None:
                logits = torch.where(inp.constraint.allowed(), logits, float("-inf"))
            tokens[:, i] = logits.argmax(dim=-1)
            if inp.constraint is not None:
                inp.constraint.advance(tokens[:, i])
        self.proposed.extend(tokens.tolist())
        return DraftProposal(tokens, None)


PROMPTS = ["The cat sat on the", "Once upon a time"]
SCHEMA_ROW = SamplingParams(max_tokens=12, regex="[a-z]{3,8}")


def run(engine: Engine, tokenizer, with_grammar_row: bool) -> list[list[int]]:
    ids = [engine.add_request(tokenizer.encode(p), SamplingParams(max_tokens=12)) for p in PROMPTS]
    if with_grammar_row:
        engine.add_request(tokenizer.encode("Name:"), SCHEMA_ROW)
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i).token_ids for i in ids]


@pytest.mark.parametrize("draft_kind", [None, "ngram", "padded"])
def test_padded_ids_never_emitted_and_rows_independent_of_grammar_rows(
    llama_target, llama_drafts, tokenizer, draft_kind
):
    target = PaddedTarget(llama_target)
    n = len(tokenizer)
    assert target.vocab_size > n

    def make():
        draft = None
        if draft_kind == "padded":
            draft = PaddedDraft(target.vocab_size, favourite=tokenizer.encode(" the")[-1])
        elif draft_kind is not None:
            draft = llama_drafts[draft_kind]
        return Engine(target, draft, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=64)), draft

    alone_engine, _ = make()
    alone = run(alone_engine, tokenizer, with_grammar_row=False)
    beside_engine, draft = make()
    beside = run(beside_engine, tokenizer, with_grammar_row=True)
    assert alone == beside
    assert all(0 <= t < n for tokens in alone for t in tokens)
    assert all(len(tokens) > 0 for tokens in alone)
    if draft_kind == "padded":
        assert draft.proposed and all(t < n for row in draft.proposed for t in row)

    plain_engine = Engine(target, None, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=64))
    assert run(plain_engine, tokenizer, with_grammar_row=False) == alone  # greedy speculative == plain


def test_the_unpadded_model_is_untouched(llama_target, tokenizer):
    """When the vocabularies agree nothing is masked: the limit is the whole vocabulary."""
    engine = Engine(llama_target, None, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=32))
    assert engine.vocab_limit == llama_target.vocab_size
