"""outlines-core backend: JSON schema (via its regex translation), regex and choice.

Compilation builds a token-level DFA index over the whole vocabulary (the expensive step); a
matcher is a cheap `Guide` over that index.
"""

from __future__ import annotations

import outlines_core
import outlines_core.json_schema
import torch
import xgrammar as xgr

from tandem.grammars.backends.base import EosTerminatedMatcher
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.tokenizer import GrammarTokenizer

NAME = "outlines"
KINDS = frozenset({"json_schema", "regex", "choice"})
MAX_ROLLBACK = 64  # tokens a Guide can undo; a mask walk needs k, a commit none.


def _vocabulary(tokenizer: GrammarTokenizer) -> outlines_core.Vocabulary:
    # xgrammar's TokenizerInfo knows how each tokenizer family encodes bytes (byte-level BPE,
    # sentencepiece byte fallback); reuse its decoded vocabulary rather than re-deriving it.
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=tokenizer.vocab_size)
    excluded = set(info.special_token_ids) | tokenizer.special_ids | {tokenizer.eos_token_id}
    tokens: dict[bytes, list[int]] = {}
    for token_id, token_bytes in enumerate(info.decoded_vocab[: len(tokenizer.hf)]):
        if token_id not in excluded and token_bytes:
            tokens.setdefault(token_bytes, []).append(token_id)
    return outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)


class OutlinesMatcher(EosTerminatedMatcher):
    """Matcher over `outlines_core.Guide` (see backends.base.Matcher for the contract)."""

    def __init__(self, index: outlines_core.Index, eos_token_id: int):
        super().__init__(eos_token_id)
        self._guide = outlines_core.Guide(index, max_rollback=MAX_ROLLBACK)

    def _advance(self, token: int) -> bool:
        try:
            self._guide.advance(token, return_tokens=False)
        except ValueError:  # no transition: the Guide keeps its state
            return False
        return True

    def _rollback(self, num_tokens: int) -> None:
        self._guide.rollback_state(num_tokens)

    def _fill(self, row: torch.Tensor) -> None:
        self._guide.write_mask_into(row.data_ptr(), row.numel(), 4)

    def _can_end(self) -> bool:
        return self._guide.is_finished()


# outlines-core puts one whitespace pattern in every gap between JSON tokens, so it cannot say
# "a space after `,` and `:` only": json.dumps's separators ("default") are approximated by at
# most one space per gap, which support.unhonoured reports (a strict spec is refused).
WHITESPACE_PATTERNS = {"default": "[ ]?", "compact": "", None: ""}


def whitespace_pattern(spec: GrammarSpec) -> str:
    """The regex build_regex_from_schema puts between JSON tokens for the spec's `whitespace`."""
    if spec.whitespace in WHITESPACE_PATTERNS:
        return WHITESPACE_PATTERNS[spec.whitespace]
    return rf"[ \t\n\r]{{0,{spec.whitespace}}}"


def compile(spec: GrammarSpec, tokenizer: GrammarTokenizer):
    """Compile `spec`; returns a zero-argument factory of fresh matchers. Raises on outlines errors."""
    vocabulary = tokenizer.view(NAME, _vocabulary)
    if spec.kind == "json_schema":
        regex = outlines_core.json_schema.build_regex_from_schema(spec.source, whitespace_pattern(spec))
    else:
        regex = spec.as_regex
    index = outlines_core.Index(regex, vocabulary)
    eos = tokenizer.eos_token_id
    return lambda: OutlinesMatcher(index, eos)
