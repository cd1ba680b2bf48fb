"""llguidance backend: JSON schema, regex, choice, Lark and EBNF (converted to Lark).

llguidance refuses JSON-schema keywords it does not implement (it is not run `lenient`), so it
fails loudly where other backends approximate.
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from tandem.core.bitmask import bitmask_width
from tandem.grammars.backends.base import EosTerminatedMatcher, token_bit
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.tokenizer import GrammarTokenizer

NAME = "llguidance"
KINDS = frozenset({"json_schema", "regex", "choice", "lark", "ebnf"})


def _tokenizer(tokenizer: GrammarTokenizer) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_token_id)


def json_whitespace_options(spec: GrammarSpec) -> dict:
    """JSON compile options for the spec's `whitespace` (exact in every mode). Passed as
    `overrides`, so a schema's own `x-guidance` options cannot loosen them."""
    if spec.whitespace == "default":
        return {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ", ", "key_separator": ": "}
    if spec.whitespace in ("compact", None):
        return {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ",", "key_separator": ":"}
    return {
        "whitespace_flexible": True,
        "item_separator": ",",
        "key_separator": ":",
        "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{spec.whitespace}}}",
    }


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=json_whitespace_options(spec))
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    if spec.kind == "ebnf":
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source))
    return llguidance.LLMatcher.grammar_from_regex(spec.as_regex)


class LLGuidanceMatcher(EosTerminatedMatcher):
    """Matcher over `llguidance.LLMatcher` (see backends.base.Matcher for the contract).

    llguidance stops by itself once nothing but EOS can follow; accepting EOS is handled by the base
    class. Its masks need no adjustment: they allow EOS exactly where the grammar may end, and EOS
    alone once stopped, so `fill_bitmask` writes straight into the destination row.

    Forced runs: where the grammar forces bytes, llguidance's mask is the first of its fast-forward
    tokens (`compute_ff_tokens`: the forced bytes as the tokenizer itself splits them), and finding
    them tokenizes the forced bytes, its costliest mask. So the run found at a state is kept: the
    state its first token leads to is masked with the run's next token, without a call, until the run
    ends or a token leaves it (a non-canonical split, which llguidance accepts). A state's run is its
    parent's less the token taken, else llguidance's own there, so the masks are a function of the
    tokens taken however the matcher got there: taking a token in a state never filled finds that
    state's run first, and a rollback keeps the runs it undid for the same tokens taken again (the
    walks' commits). Asked afresh inside a run, llguidance splits the rest of the forced bytes again,
    which gave the run's next token at every such state of MaskBench's instance walks
    (tests/grammars/test_forced_runs.py checks long keys and constants); either way the mask allows
    only a piece of the forced bytes, so what the grammar accepts never changes.
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int, row_bytes: int):
        super().__init__(eos_token_id)
        self._matcher = matcher
        self._row_bytes = row_bytes  # 4 * ceil(V / 32): one bitmask row
        # Per state on the path (the start, then after each token taken): its forced run, [] where none
        # is forced, None until found. A rollback moves what it undoes, (token, the run after it), to
        # `_undone`, last undone first, until another token is taken.
        self._runs: list[list[int] | None] = [None]
        self._taken: list[int] = []
        self._undone: list[tuple[int, list[int] | None]] = []
        # The last bitmask a run's token was written to, its data pointer and numpy view: a walk fills
        # one buffer row by row.
        self._words: tuple[torch.Tensor | None, int, np.ndarray | None] = (None, 0, None)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        # The mask is per-token hot (a fill is a few microseconds): no row view, no base-class calls.
        if self._ended:
            bitmask[index].zero_()
            return
        offset = index * self._row_bytes
        if offset + self._row_bytes > bitmask.nbytes:  # a raw pointer write must stay inside the buffer
            raise ValueError(f"bitmask of {bitmask.nbytes} bytes has no row {index} of {self._row_bytes} bytes")
        run = self._runs[-1]
        if run is None:
            run = self._runs[-1] = self._matcher.compute_ff_tokens()
        if run:  # the one token llguidance's mask would allow here; numpy writes it (torch: a dispatch per op)
            held, pointer, words = self._words
            if held is not bitmask or pointer != bitmask.data_ptr():
                self._words = bitmask, bitmask.data_ptr(), (words := bitmask.numpy())
            token = run[0]
            words[index] = 0
            words[index, token >> 5] = token_bit(token)
        else:
            self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + offset, self._row_bytes)

    def _advance(self, token: int) -> bool:
        redo = bool(self._undone) and self._undone[-1][0] == token
        run = self._runs[-1]
        if run is None and not redo:  # this state's run decides the next state's
            run = self._runs[-1] = self._matcher.compute_ff_tokens()
        # try_consume_tokens leaves the matcher untouched on a forbidden token (consume_token would
        # put it in a permanent error state).
        if self._matcher.try_consume_tokens([token]) != 1:
            return False
        if redo:
            self._runs.append(self._undone.pop()[1])
        else:
            self._undone.clear()
            self._runs.append(run[1:] if len(run) > 1 and run[0] == token else None)
        self._taken.append(token)
        return True

    def _rollback(self, num_tokens: int) -> None:
        if not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance rollback of {num_tokens} failed: {self._matcher.get_error()}")
        self._undone.extend(zip(reversed(self._taken[-num_tokens:]), reversed(self._runs[-num_tokens:])))
        del self._taken[-num_tokens:], self._runs[-num_tokens:]

    def _can_end(self) -> bool:
        return self._matcher.is_accepting()


def compile(spec: GrammarSpec, tokenizer: GrammarTokenizer):
    """Compile `spec`; returns a zero-argument factory of fresh matchers. Raises ValueError on errors."""
    ll_tokenizer = tokenizer.view(NAME, _tokenizer)
    template = llguidance.LLMatcher(ll_tokenizer, _grammar_text(spec), log_level=0)
    if template.is_error():
        raise ValueError(template.get_error())
    eos, row_bytes = tokenizer.eos_token_id, 4 * bitmask_width(tokenizer.vocab_size)
    return lambda: LLGuidanceMatcher(template.deep_copy(), eos, row_bytes)
