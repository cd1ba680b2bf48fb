"""The keyword-support table: the schema walk, and a re-measurement of a sample of the table."""

from __future__ import annotations

import pytest

from tandem.grammars.backends import BACKENDS
from tandem.grammars.compiler import GrammarCompiler
from tandem.grammars.evaluate import honoured_labels, measure_suite
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.support import HONOURED, schema_assertions, unhonoured
from tests.grammars.conftest import SCHEMA_SUITE

# Suite files re-measured here: cheap to compile (no outlines DFA blow-up, so no timeouts), and
# they cover honoured and refused entries.
SAMPLE = {
    "xgrammar": ["uniqueItems", "not", "maxLength", "required", "minimum", "enum"],
    "llguidance": ["uniqueItems", "not", "maxLength", "required", "minimum", "enum"],
    "outlines": ["minimum", "maximum", "enum", "const"],
}


def test_walk_reports_every_subschema_with_its_pointer():
    schema = {
        "type": "object",
        "properties": {"a/b": {"type": "string", "maxLength": 3}, "c": {"items": {"not": {"const": 1}}}},
        "$defs": {"d": {"uniqueItems": True, "format": "email"}},
        "anyOf": [{"required": ["x"]}, False],
        "title": "annotations are not assertions",
        "format": "not-a-defined-format",
    }
    assert sorted(schema_assertions(schema)) == sorted([
        ("/type", "type"), ("/properties", "properties"), ("/anyOf", "anyOf"),
        ("/properties/a~1b/type", "type"), ("/properties/a~1b/maxLength", "maxLength"),
        ("/properties/c/items", "items@untyped"), ("/properties/c/items/not", "not"),
        ("/properties/c/items/not/const", "const"),
        ("/$defs/d/uniqueItems", "uniqueItems@untyped"), ("/$defs/d/format", "format:email@untyped"),
        ("/anyOf/0/required", "required:undeclared@untyped"), ("/anyOf/1", "false"),
    ])  # fmt: skip


def test_unhonoured_lists_pointer_and_keyword_and_ignores_non_schema_specs():
    spec = GrammarSpec.json_schema({"type": "array", "items": {"type": "integer", "not": {"const": 0}}, "uniqueItems": True})
    assert unhonoured(spec, "xgrammar") == ["/uniqueItems: uniqueItems", "/items/not: not"]
    assert unhonoured(GrammarSpec.regex("a+"), "outlines") == []


@pytest.mark.skipif(not SCHEMA_SUITE.is_dir(), reason=f"JSON-Schema-Test-Suite not at {SCHEMA_SUITE}")
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_table_sample_matches_a_fresh_measurement(backend, tokenizer):
    files = [SCHEMA_SUITE / f"{name}.json" for name in SAMPLE[backend]]
    compiler = GrammarCompiler(timeout_s=20)
    measured = measure_suite(files, backend, tokenizer, compiler)
    compiler.shutdown()
    honoured = set(honoured_labels(measured))
    for label in measured:
        assert (label in HONOURED[backend]) == (label in honoured), f"{backend}: {label} {measured[label]}"
