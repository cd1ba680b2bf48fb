"""Compilation: refusals of silent approximations, auto selection, the cache and the time limit."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tandem.cli.eval_schemas import walk_instance
from tandem.core.bitmask import bitmask_width
from tandem.grammars.backends import BACKENDS
from tandem.grammars.compiler import AUTO_ORDER, GrammarCompiler, compile_grammar, lowered
from tandem.grammars.errors import GrammarCompileError, GrammarCompileTimeout, GrammarRefused
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.support import unhonoured

UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
NOT = {"type": "object", "properties": {"a": {"type": "integer", "not": {"multipleOf": 3}}}}  # no complement


def test_xgrammar_refuses_unique_items_and_not_naming_them(tokenizer):
    with pytest.raises(GrammarRefused, match=r"'xgrammar' cannot honour /uniqueItems: uniqueItems.*strict=False"):
        compile_grammar(GrammarSpec.json_schema(UNIQUE), tokenizer, "xgrammar")
    with pytest.raises(GrammarRefused, match=r"/properties/a/not: not"):
        compile_grammar(GrammarSpec.json_schema(NOT), tokenizer, "xgrammar")


def test_strict_false_accepts_the_approximation(tokenizer):
    compiled = compile_grammar(GrammarSpec.json_schema(UNIQUE, strict=False), tokenizer, "xgrammar")
    matcher = compiled.new_matcher()
    for token in tokenizer.encode("[1,1]") + [tokenizer.eos_token_id]:  # duplicates pass: approximated
        assert matcher.accept_token(token)


def test_xgrammar_refuses_required_names_missing_from_properties(tokenizer):
    with pytest.raises(GrammarRefused, match="required:undeclared"):
        compile_grammar(GrammarSpec.json_schema({"type": "object", "required": ["a"]}), tokenizer, "xgrammar")


def test_outlines_refuses_numeric_bounds(tokenizer):
    with pytest.raises(GrammarRefused, match="minimum"):
        compile_grammar(GrammarSpec.json_schema({"type": "integer", "minimum": 3}), tokenizer, "outlines")


def test_auto_picks_a_backend_that_honours_the_schema(tokenizer):
    compiled = compile_grammar(GrammarSpec.json_schema({"type": "integer", "minimum": 3}), tokenizer, "auto")
    assert compiled.backend in AUTO_ORDER and compiled.backend != "outlines"
    matcher = compiled.new_matcher()
    assert not matcher.accept_token(tokenizer.encode("1")[0]) or not matcher.accept_token(tokenizer.eos_token_id)


def test_auto_fails_with_every_backends_reason_when_none_can_honour(tokenizer):
    # llguidance rejects uniqueItems loudly; the others would ignore it, so they refuse.
    with pytest.raises(
        GrammarCompileError, match="llguidance: .*uniqueItems.*'xgrammar' cannot honour /uniqueItems: uniqueItems"
    ):
        compile_grammar(GrammarSpec.json_schema(UNIQUE), tokenizer, "auto")


def test_backend_without_the_spec_kind_says_so(tokenizer):
    with pytest.raises(GrammarCompileError, match="'outlines' does not compile lark grammars"):
        compile_grammar(GrammarSpec.lark('start: "a"'), tokenizer, "outlines")
    with pytest.raises(ValueError, match="unknown grammar backend 'nope'"):
        compile_grammar(GrammarSpec.regex("a"), tokenizer, "nope")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_backend_compiles_regex_and_choice_exactly(tokenizer, backend):
    for spec, good, bad in [
        (GrammarSpec.regex("[0-9]{2}-ab"), "42-ab", "4-ab"),
        (GrammarSpec.choice(["yes", "no"]), "no", "nope"),
    ]:
        compiled = compile_grammar(spec, tokenizer, backend)
        for text, expected in ((good, True), (bad, False)):
            matcher = compiled.new_matcher()
            ok = all(matcher.accept_token(t) for t in tokenizer.encode(text) + [tokenizer.eos_token_id])
            assert ok == expected, (backend, text)


def test_cache_returns_the_same_compiled_grammar(tokenizer):
    compiler = GrammarCompiler()
    spec = GrammarSpec.json_schema({"type": "string"})
    first = compiler.compile(spec, tokenizer, "llguidance")
    assert compiler.compile(GrammarSpec.json_schema('{"type": "string"}'), tokenizer, "llguidance") is first
    assert compiler.compile(spec, tokenizer, "xgrammar") is not first
    compiler.shutdown()


def test_a_slow_compile_times_out_without_stalling_others(tokenizer, monkeypatch):
    release = threading.Event()

    def slow_compile(spec, tokenizer):
        release.wait(5)
        return lambda: None

    slow = SimpleNamespace(NAME="slow", KINDS=frozenset({"regex"}), compile=slow_compile)
    monkeypatch.setitem(BACKENDS, "slow", slow)
    compiler = GrammarCompiler(max_workers=2, timeout_s=0.3)
    slow_job = compiler.submit(GrammarSpec.regex("a"), tokenizer, "slow")
    fast_job = compiler.submit(GrammarSpec.regex("b"), tokenizer, "xgrammar")
    assert fast_job.result().backend == "xgrammar"  # done while the slow one still runs
    assert not slow_job.done()
    start = time.monotonic()
    with pytest.raises(GrammarCompileTimeout):
        slow_job.result()
    assert time.monotonic() - start < 1.0 and slow_job.done()
    release.set()
    compiler.shutdown()


def test_jobs_queued_behind_a_stuck_compile_move_to_a_fresh_worker(tokenizer, monkeypatch):
    release = threading.Event()
    slow = SimpleNamespace(
        NAME="slow", KINDS=frozenset({"regex"}), compile=lambda spec, tok: release.wait(5) and (lambda: None)
    )
    monkeypatch.setitem(BACKENDS, "slow", slow)
    compiler = GrammarCompiler(max_workers=1, timeout_s=0.3)
    stuck = compiler.submit(GrammarSpec.regex("a"), tokenizer, "slow")
    queued = compiler.submit(GrammarSpec.regex("b"), tokenizer, "xgrammar")  # behind it, same worker
    assert queued.result().backend == "xgrammar"  # the limit counts from start, and it got a new worker
    with pytest.raises(GrammarCompileTimeout, match="0.3 s time limit"):
        stuck.result()
    release.set()
    compiler.shutdown()


@pytest.mark.parametrize(
    "spec, backend",
    [
        (GrammarSpec.lark('start: "ab" NUM\nNUM: /[0-9]+/'), "llguidance"),
        (GrammarSpec.ebnf('root ::= "ab" [0-9]+'), "xgrammar"),
        (GrammarSpec.ebnf('root ::= "ab" [0-9]+'), "llguidance"),
    ],
)
def test_grammar_specs_compile_on_the_backends_that_take_them(tokenizer, spec, backend):
    compiled = compile_grammar(spec, tokenizer, backend)
    for text, expected in (("ab12", True), ("ab", False), ("ba1", False)):
        matcher = compiled.new_matcher()
        assert all(matcher.accept_token(t) for t in tokenizer.encode(text) + [tokenizer.eos_token_id]) == expected, text


def test_model_vocab_smaller_than_the_tokenizer_is_an_error(hf_tokenizer):
    from tandem.grammars.tokenizer import GrammarTokenizer

    with pytest.raises(ValueError, match=f"model vocab_size 10 < tokenizer size {len(hf_tokenizer)}"):
        GrammarTokenizer(hf_tokenizer, vocab_size=10)


def test_auto_takes_llguidance_first_even_where_xgrammar_honours_the_schema(tokenizer):
    """llguidance's masks keep the tokenizer's own splits of keys and constants (xgrammar's allow every
    split, which led demo answers astray), so auto takes it wherever it honours the schema."""
    closed = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    spec = GrammarSpec.json_schema(closed)
    assert not unhonoured(lowered(spec, "xgrammar"), "xgrammar")
    assert compile_grammar(spec, tokenizer).backend == "llguidance"


def test_older_drafts_compile_after_normalisation_and_remote_refs_are_refused_by_url(tokenizer):
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "definitions": {"n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}},
        "type": "object",
        "properties": {"t": {"type": "array", "items": [{"$ref": "#/definitions/n"}], "additionalItems": False}},
        "dependencies": {"t": ["u"]},
    }
    compiled = compile_grammar(GrammarSpec.json_schema(draft4), tokenizer, "llguidance")
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)

    def accepts(text: str) -> bool:
        return walk_instance(compiled, tokenizer.encode(text), tokenizer.eos_token_id, buffer, [])

    assert accepts('{"t":[1],"u":0}') and accepts('{"u":0}')
    # exclusive minimum, additionalItems: false, the dependency of t on u
    assert not accepts('{"t":[0],"u":0}') and not accepts('{"t":[1,2],"u":0}') and not accepts('{"t":[1]}')
    remote = {"properties": {"a": {"$ref": "https://example.com/a.json"}}}
    for backend in ("auto", *AUTO_ORDER):
        with pytest.raises(GrammarRefused, match=r"/properties/a/\$ref: \$ref https://example.com/a.json is remote"):
            compile_grammar(GrammarSpec.json_schema(remote, strict=False), tokenizer, backend)
