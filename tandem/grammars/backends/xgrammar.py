"""xgrammar backend: JSON schema, regex, choice and EBNF via `xgrammar.GrammarCompiler`."""

from __future__ import annotations

import torch
import xgrammar as xgr

from tandem.grammars.spec import GrammarSpec
from tandem.grammars.tokenizer import GrammarTokenizer

NAME = "xgrammar"
KINDS = frozenset({"json_schema", "regex", "choice", "ebnf"})


def _compiler(tokenizer: GrammarTokenizer) -> xgr.GrammarCompiler:
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=tokenizer.vocab_size)
    # xgrammar only treats tokens that decode to "" as special; blank every control token so a
    # grammar never allows e.g. "</think>" inside a JSON string.
    encoded = tokenizer.hf.convert_ids_to_tokens(list(range(len(tokenizer.hf))))
    for token_id in tokenizer.special_ids:
        encoded[token_id] = ""
    info = xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=[tokenizer.eos_token_id],
        add_prefix_space=detected.add_prefix_space,
    )
    return xgr.GrammarCompiler(info, max_threads=1)


class XGrammarMatcher:
    """Matcher over `xgrammar.GrammarMatcher` (see backends.base.Matcher for the contract)."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token: int) -> bool:
        # After EOS every token is refused; xgrammar would also log a warning for each (a walk
        # probes drafts past an accepted EOS).
        return not self._matcher.is_terminated() and self._matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self._matcher.is_terminated():  # xgrammar raises on a mask request after EOS
            bitmask[index].zero_()
        else:
            self._matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def json_whitespace_options(spec: GrammarSpec) -> dict:
    """compile_json_schema's whitespace arguments for the spec's `whitespace` (exact in every mode)."""
    if spec.whitespace == "default":
        return {"any_whitespace": False, "separators": (", ", ": ")}
    if spec.whitespace in ("compact", None):
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True, "max_whitespace_cnt": spec.whitespace}


def compile(spec: GrammarSpec, tokenizer: GrammarTokenizer):
    """Compile `spec`; returns a zero-argument factory of fresh matchers. Raises on xgrammar errors."""
    compiler = tokenizer.view(NAME, _compiler)
    if spec.kind == "json_schema":
        # strict_mode=False: additionalProperties defaults to true, as JSON Schema says.
        compiled = compiler.compile_json_schema(spec.source, strict_mode=False, **json_whitespace_options(spec))
    elif spec.kind == "ebnf":
        compiled = compiler.compile_grammar(spec.source)
    else:
        compiled = compiler.compile_regex(spec.as_regex)
    return lambda: XGrammarMatcher(compiled)
