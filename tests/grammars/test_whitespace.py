"""Bounded whitespace in JSON grammars (issue 30): every backend, every `GrammarSpec.whitespace` mode,
walked with the backends' matchers over a schema with an object and an array."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tandem.core.bitmask import bitmask_width
from tandem.grammars.backends import BACKENDS
from tandem.grammars.compiler import GrammarCompiler, compile_grammar
from tandem.grammars.errors import GrammarRefused, InvalidGrammarSpec
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.support import unhonoured

TRIP_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "stay": {"type": "object", "properties": {"hotel": {"type": "string"}}, "required": ["hotel"]},
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
    },
    "required": ["city", "days", "stay", "items"],
    "additionalProperties": False,
}
TRIP = {"city": "Paris", "days": 3, "stay": {"hotel": "Ritz"}, "items": ["map", "hat", "pen"]}
DUMPS = json.dumps(TRIP)  # {"city": "Paris", "days": 3, ...}: json.dumps's default separators
COMPACT = json.dumps(TRIP, separators=(",", ":"))
TWO_SPACES = DUMPS.replace(", ", ",  ", 1)
NEWLINES = DUMPS.replace(", ", ",\n\n\n", 1)
IN_ARRAY = DUMPS.replace('"map", ', '"map",  ')


def _walk(new_matcher, tokenizer, tokens: list[int]) -> bool:
    """Whether masked decoding can emit `tokens` then EOS: every token in its mask and accepted."""
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    matcher = new_matcher()
    for token in [*tokens, tokenizer.eos_token_id]:
        matcher.fill_bitmask(buffer, 0)
        if not (int(buffer[0, token >> 5]) >> (token & 31)) & 1 or not matcher.accept_token(token):
            return False
    return matcher.is_terminated()


def accepts(new_matcher, tokenizer, text: str) -> bool:
    """Whether `text`, as the tokenizer encodes it, can be emitted (llguidance's masks hold only the
    tokenizer's own tokenization where the grammar forces text)."""
    return _walk(new_matcher, tokenizer, tokenizer.encode(text))


def refuses(new_matcher, tokenizer, text: str) -> bool:
    """Whether `text` can be emitted neither as encoded nor with each whitespace character its own
    token (a run is then never one token: a bound is checked per character, as a model may emit it)."""
    per_char = [t for part in re.split(r"(\s)", text) if part for t in tokenizer.encode(part)]
    return not accepts(new_matcher, tokenizer, text) and not _walk(new_matcher, tokenizer, per_char)


@pytest.fixture(scope="module")
def compiled(tokenizer):
    cache = {}

    def get(backend, whitespace):
        key = (backend, whitespace)
        if key not in cache:
            spec = GrammarSpec.json_schema(TRIP_SCHEMA, whitespace=whitespace)
            cache[key] = BACKENDS[backend].compile(spec, tokenizer)
        return cache[key]

    return get


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_default_accepts_json_dumps_and_refuses_runs(backend, compiled, tokenizer):
    new_matcher = compiled(backend, "default")
    assert accepts(new_matcher, tokenizer, DUMPS)
    for text in (TWO_SPACES, NEWLINES, IN_ARRAY, DUMPS + " ", DUMPS.replace(": ", ":  ", 1)):
        assert refuses(new_matcher, tokenizer, text), (backend, text)
    if backend != "outlines":  # exact: nothing but json.dumps's separators
        assert refuses(new_matcher, tokenizer, COMPACT)
        assert refuses(new_matcher, tokenizer, DUMPS.replace("{", "{ ", 1))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_compact_accepts_only_the_compact_form(backend, compiled, tokenizer):
    new_matcher = compiled(backend, "compact")
    assert accepts(new_matcher, tokenizer, COMPACT)
    for text in (DUMPS, COMPACT.replace(",", ", ", 1), COMPACT.replace("[", "[\n", 1), TWO_SPACES):
        assert refuses(new_matcher, tokenizer, text), (backend, text)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("n", [1, 3])
def test_bounded_accepts_up_to_n_and_refuses_n_plus_one(backend, n, compiled, tokenizer):
    new_matcher = compiled(backend, n)
    assert accepts(new_matcher, tokenizer, COMPACT)
    assert accepts(new_matcher, tokenizer, DUMPS)
    for ws in (" " * n, "\n" * n, " \t\n\r"[:n] if n > 1 else "\n"):
        assert accepts(new_matcher, tokenizer, COMPACT.replace(",", "," + ws, 1)), (backend, ws)
        assert accepts(new_matcher, tokenizer, COMPACT.replace("[", "[" + ws).replace(":", ws + ":", 1))
    for ws in (" " * (n + 1), "\n" * (n + 1)):
        assert refuses(new_matcher, tokenizer, COMPACT.replace(",", "," + ws, 1)), (backend, ws)
        assert refuses(new_matcher, tokenizer, COMPACT.replace('","', '",' + ws + '"')), (backend, ws)


def test_outlines_cannot_say_json_dumps_separators_exactly_so_strict_specs_go_elsewhere(tokenizer):
    simple = {"type": "array", "prefixItems": [{"enum": ["a", "b"]}, {"type": "boolean"}], "maxItems": 2}
    with pytest.raises(GrammarRefused, match="cannot honour /: whitespace:default;"):
        compile_grammar(GrammarSpec.json_schema(simple, whitespace="default"), tokenizer, "outlines")
    for whitespace in ("compact", 2):  # exact on outlines too
        assert compile_grammar(GrammarSpec.json_schema(simple, whitespace=whitespace), tokenizer, "outlines")
        assert "/: whitespace" not in str(
            unhonoured(GrammarSpec.json_schema(TRIP_SCHEMA, whitespace=whitespace), "outlines")
        )
    for backend in ("llguidance", "xgrammar"):
        assert not unhonoured(GrammarSpec.json_schema(TRIP_SCHEMA, whitespace="default"), backend)
    assert compile_grammar(GrammarSpec.json_schema(simple, whitespace="default"), tokenizer).backend != "outlines"
    # non-strict: the approximation, at most one space in any gap (still never a run)
    spec = GrammarSpec.json_schema(TRIP_SCHEMA, whitespace="default", strict=False)
    approx = compile_grammar(spec, tokenizer, "outlines")
    assert accepts(approx.new_matcher, tokenizer, DUMPS) and refuses(approx.new_matcher, tokenizer, TWO_SPACES)


@pytest.mark.parametrize(
    "options",
    [
        {"whitespace_flexible": True},
        {"whitespace_pattern": "[ ]*"},
        {"whitespace_flexible": True, "item_separator": ",  "},
    ],
)
@pytest.mark.parametrize("whitespace", ["default", "compact", 1])
def test_a_schema_cannot_loosen_the_bound_through_x_guidance(options, whitespace, tokenizer):
    schema = {**TRIP_SCHEMA, "x-guidance": options}
    new_matcher = BACKENDS["llguidance"].compile(GrammarSpec.json_schema(schema, whitespace=whitespace), tokenizer)
    assert accepts(new_matcher, tokenizer, COMPACT if whitespace == "compact" else DUMPS)
    assert refuses(new_matcher, tokenizer, TWO_SPACES) and refuses(new_matcher, tokenizer, NEWLINES)


def test_whitespace_is_part_of_the_spec_and_the_cache_key(tokenizer):
    specs = [GrammarSpec.json_schema(TRIP_SCHEMA, whitespace=w) for w in ("default", "compact", 2, 0)]
    assert len({*specs}) == 3 and specs[1] == specs[3]  # 0 is "compact"
    compiler = GrammarCompiler()
    try:
        grammars = [compiler.compile(spec, tokenizer, "xgrammar") for spec in specs[:3]]
        assert len({id(g) for g in grammars}) == 3
        assert compiler.compile(specs[3], tokenizer, "xgrammar") is grammars[1]
        assert [accepts(g.new_matcher, tokenizer, DUMPS) for g in grammars] == [True, False, True]
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("bad", ["pretty", -1, 65, True, 1.5, None])
def test_an_invalid_whitespace_is_refused_with_what_is_allowed(bad):
    with pytest.raises(InvalidGrammarSpec, match="'default'.*'compact'.*0..64"):
        GrammarSpec.json_schema(TRIP_SCHEMA, whitespace=bad)
