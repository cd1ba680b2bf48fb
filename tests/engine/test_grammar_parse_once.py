"""A request's grammar is parsed once: the runner (`LLM.generate`, the server) compiles it before it adds each job
(`Engine.compile_grammar`, then `Engine.add_request` -> `check_request` per job), and every one of them reads the
same text. Counted at the parsers `GrammarSpec` validates with (xgrammar's GBNF/EBNF, llguidance's Lark); a
backend's compilation (once per spec, `GrammarCompiler`'s cache) is not counted."""

from __future__ import annotations

import types
import uuid

import pytest

from tandem.decoding.params import SamplingParams
from tandem.engine.engine import Engine, EngineConfig
from tandem.grammars import spec as spec_module
from tandem.grammars.errors import InvalidGrammarSpec
from tandem.grammars.spec import GrammarSpec


def _parsers(monkeypatch) -> dict[str, int]:
    """Count the parses `GrammarSpec` asks of each library; returns the counts, by dialect."""
    counts = {"ebnf": 0, "lark": 0}
    xgrammar, llguidance = spec_module.xgrammar, spec_module.llguidance

    def from_ebnf(text):
        counts["ebnf"] += 1
        return xgrammar.Grammar.from_ebnf(text)

    def validate_grammar(grammar):
        counts["lark"] += 1
        return llguidance.LLMatcher.validate_grammar(grammar)

    matcher = types.SimpleNamespace(
        grammar_from_lark=llguidance.LLMatcher.grammar_from_lark, validate_grammar=validate_grammar
    )
    monkeypatch.setattr(
        spec_module, "xgrammar", types.SimpleNamespace(Grammar=types.SimpleNamespace(from_ebnf=from_ebnf))
    )
    monkeypatch.setattr(spec_module, "llguidance", types.SimpleNamespace(LLMatcher=matcher))
    return counts


def _unique(dialect: str) -> str:
    """A grammar text no earlier test parsed: a fresh literal before two digits."""
    word = uuid.uuid4().hex
    if dialect == "lark":
        return f'start: "{word}" DIGIT DIGIT\nDIGIT: /[0-9]/'
    return f'root ::= "{word}" [0-9] [0-9]'


@pytest.mark.parametrize("dialect, parses", [("lark", {"ebnf": 1, "lark": 1}), ("ebnf", {"ebnf": 1, "lark": 0})])
def test_a_requests_grammar_is_parsed_once_for_all_its_jobs(models, monkeypatch, dialect, parses):
    """As `LLM.generate` does: compile first (its errors before anything runs), then add each prompt. A Lark text is
    tried as GBNF first (`GrammarSpec.grammar`), once too."""
    target, _, tokenizer = models("demo-llama", None)
    engine = Engine(target, None, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=256, adaptive=False))
    counts = _parsers(monkeypatch)
    params = SamplingParams(max_tokens=64, grammar=_unique(dialect))
    engine.compile_grammar(params).result()
    prompt = tokenizer.encode("Say a number:")
    ids = [engine.add_request(prompt, params) for _ in range(3)]
    assert counts == parses
    while engine.has_unfinished():  # the jobs run under the grammar: two digits after the literal
        engine.step()
    literal = params.grammar.split('"')[1]
    for request_id in ids:
        text = tokenizer.decode(engine.pop_finished(request_id).token_ids, skip_special_tokens=True)
        assert text.startswith(literal) and len(text) == len(literal) + 2 and text[-2:].isdigit(), text


def test_an_invalid_grammar_fails_with_its_message_every_time():
    """A bad text's errors are kept as the parsers gave them: each attempt raises the same message."""
    for _ in range(2):
        with pytest.raises(InvalidGrammarSpec, match="neither GBNF/EBNF nor Lark: ebnf: .*; lark: "):
            GrammarSpec.grammar("root ::= 'a")
        with pytest.raises(InvalidGrammarSpec, match="lark: .*unknown name"):
            GrammarSpec.lark("start: foo")
        with pytest.raises(InvalidGrammarSpec, match="ebnf: .*"):
            GrammarSpec.ebnf("root ::= undefined_rule")
