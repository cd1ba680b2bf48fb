"""The keyword-support table: the schema walk, and a re-measurement of a sample of the table."""

from __future__ import annotations

import pytest
import torch

from tandem.cli.eval_schemas import honoured_labels, instance_text, measure_suite, walk_instance
from tandem.core.bitmask import bitmask_width
from tandem.grammars.backends import BACKENDS
from tandem.grammars.compiler import GrammarCompiler, compile_grammar
from tandem.grammars.errors import GrammarError
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.support import (
    HONOURED,
    HONOURED_BEYOND_SUITE,
    HONOURED_COMBINATIONS,
    IGNORED_BEYOND_SUITE,
    NARROWED,
    narrowed,
    schema_assertions,
    unhonoured,
)
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
        ("/type", "type"), ("/properties", "properties"), ("/anyOf", "anyOf"), ("/anyOf", "anyOf:with-properties"),
        ("/properties/a~1b/type", "type"), ("/properties/a~1b/maxLength", "maxLength"),
        ("/properties/c/items", "items@untyped"), ("/properties/c/items/not", "not"),
        ("/properties/c/items/not/const", "const"),
        ("/$defs/d/uniqueItems", "uniqueItems@untyped"), ("/$defs/d/format", "format:email@untyped"),
        ("/anyOf/0/required", "required:undeclared@untyped"), ("/anyOf/1", "false"),
    ])  # fmt: skip


def test_unhonoured_lists_pointer_and_keyword_and_ignores_non_schema_specs():
    spec = GrammarSpec.json_schema(
        {"type": "array", "items": {"type": "integer", "not": {"const": 0}}, "uniqueItems": True}
    )
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


# enum/const beside keywords that rule some listed values out (MaskBench Github_easy---o30060:
# `{"enum": ["MODIFIABLE", ...], "type": "object"}`), each with an instance that is listed but invalid.
CONFLICTING_SIBLINGS = [
    ({"type": "object", "properties": {"a": {"enum": ["X", "Y"], "type": "object"}}}, {"a": "X"}, "enum:unfiltered"),
    ({"enum": ["X", 3], "type": "integer"}, "X", "enum:unfiltered"),
    ({"enum": ["X", "YYYY"], "type": "string", "maxLength": 2}, "YYYY", "enum:unfiltered"),
    ({"enum": [1, 5], "type": "integer", "minimum": 3}, 1, "enum:unfiltered"),
    ({"const": "X", "type": "integer"}, "X", "const:unfiltered"),
]


def test_enum_and_const_are_labelled_unfiltered_only_when_a_sibling_rules_a_value_out():
    for schema, _, label in CONFLICTING_SIBLINGS:
        assert label in {found for _, found in schema_assertions(schema)}, schema
    fitting = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "enum": ["x", "y"], "maxLength": 1},
            "b": {"type": ["integer", "null"], "const": None},
        },
    }
    assert not [label for _, label in schema_assertions(fitting) if label.endswith(":unfiltered")]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_enum_and_const_with_conflicting_siblings_are_honoured_or_refused(backend, tokenizer):
    """Measures HONOURED_BEYOND_SUITE: a backend listed there rejects every such instance (or fails
    to compile); the others let some through, so strict specs must be refused by them."""
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    unsound = []
    for schema, invalid, label in CONFLICTING_SIBLINGS:
        try:  # non-strict: what the backend really does
            compiled = compile_grammar(GrammarSpec.json_schema(schema, strict=False), tokenizer, backend)
        except GrammarError:
            continue
        if walk_instance(compiled, tokenizer.encode(instance_text(invalid)), tokenizer.eos_token_id, buffer, []):
            unsound.append(label)
            assert f"/{'properties/a/' if 'properties' in schema else ''}{label.split(':')[0]}: {label}" in unhonoured(
                GrammarSpec.json_schema(schema), backend
            )
    honoured = HONOURED_BEYOND_SUITE.get(backend, frozenset())
    assert not set(unsound) & honoured, f"{backend} lets {unsound} through but the table says it honours them"
    assert backend not in HONOURED_BEYOND_SUITE or not unsound


# `not` over object keywords, reduced from MaskBench Github_trivial---o91408 and Handwritten---pnmp10,
# each with an instance the `not` rules out.
# (`not` of `required`, `minProperties`, `anyOf`... is now rewritten exactly (lowering.py `negate`);
# `propertyNames: {maxLength}` has no complement, so keeps it a `not`.)
NOT_OVER_OBJECT_KEYWORDS = [
    ({"type": "object", "properties": {"body": {"type": "string"}, "bodyValue": {"type": "string"}},
      "not": {"required": ["body", "bodyValue"], "propertyNames": {"maxLength": 9}}}, {"body": "a", "bodyValue": "b"}),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "not": {"anyOf": [{"required": ["a"]}, {"propertyNames": {"maxLength": 0}}]}}, {"a": 1}),
]  # fmt: skip


@pytest.mark.parametrize("backend", sorted(IGNORED_BEYOND_SUITE))
def test_keywords_ignored_beyond_the_suite_let_invalid_instances_through_and_are_refused(backend, tokenizer):
    """Measures IGNORED_BEYOND_SUITE: without the override the backend is unsound on these schemas."""
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    for schema, invalid in NOT_OVER_OBJECT_KEYWORDS:
        compiled = compile_grammar(GrammarSpec.json_schema(schema, strict=False), tokenizer, backend)
        assert walk_instance(compiled, tokenizer.encode(instance_text(invalid)), tokenizer.eos_token_id, buffer, [])
        assert "/not: not" in unhonoured(GrammarSpec.json_schema(schema), backend)
        with pytest.raises(GrammarError, match="/not: not"):
            compile_grammar(GrammarSpec.json_schema(schema), tokenizer, backend)


# Keywords that meet in one subschema, reduced from MaskBench (see support.HONOURED_COMBINATIONS),
# each with an instance only the combination rules out.
COMBINATIONS = [
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abcd", "pattern:with-length"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "ab", "pattern:with-length"),
    ({"type": "string", "format": "email", "pattern": "^a"}, "b@c.com", "pattern:with-format"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {"^a": {"maxLength": 2}}},
     {"a": "xyz"}, "patternProperties:overlapping"),
    ({"type": "object", "properties": {"a": {"type": "boolean"}}, "patternProperties": {".*": {"type": "boolean"}}},
     {"a": True, "b": "x"}, "patternProperties:overlapping"),
    ({"type": "object", "properties": {"a": {"type": "number"}}, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
     {"a": "x"}, "anyOf:with-properties"),
]  # fmt: skip


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_keyword_combinations_are_honoured_or_refused(backend, tokenizer):
    """Measures HONOURED_COMBINATIONS: a backend listed for a label rejects every such instance (or
    fails to compile); one that lets an instance through is not listed, and refuses it strict."""
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    honoured = HONOURED_COMBINATIONS.get(backend, frozenset())
    for schema, invalid, label in COMBINATIONS:
        assert label in {found for _, found in schema_assertions(schema)}, schema
        try:
            compiled = compile_grammar(GrammarSpec.json_schema(schema, strict=False), tokenizer, backend)
        except GrammarError:
            continue
        if walk_instance(compiled, tokenizer.encode(instance_text(invalid)), tokenizer.eos_token_id, buffer, []):
            assert label not in honoured, f"{backend} lets {invalid!r} through {schema}"
            assert any(item.endswith(f": {label}") for item in unhonoured(GrammarSpec.json_schema(schema), backend))


# Valid instances some backend rejects (MaskBench Github_easy---o10094, o1008): support.NARROWED
# lists a label for a backend that rejects while another accepts.
NARROWING = [
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}, '{"b":1,"a":2}',
     "properties:several"),  # declared order forced
    ({"type": "object", "properties": {"p": {"type": "object"}}}, '{"p":{"a":1,"b":2}}', "any"),  # one free key
    ({"type": "object", "properties": {"p": {"type": "array"}}}, '{"p":["a","b"]}', "any"),  # one free item
    ({"type": "object", "properties": {"p": {"description": "x"}}}, '{"p":{"a":1,"b":2}}', "any"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1,"b":[1,2]}', "any"),  # undeclared
    ({"type": "object", "patternProperties": {"[a-z]+": {"type": "integer"}}, "additionalProperties": False},
     '{"ab1":1}', "patternProperties"),  # read as anchored
    ({"type": "string", "maxLength": 10}, '"a\\nb"', "maxLength"),  # an escape
    ({"type": "string", "minLength": 2}, '"a\\nb"', "minLength"),
]  # fmt: skip


def test_narrowed_labels_are_where_a_backend_rejects_valid_instances_another_accepts(tokenizer):
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    for schema, valid, label in NARROWING:
        spec = GrammarSpec.json_schema(schema)
        accepted = {
            backend: walk_instance(
                compile_grammar(spec, tokenizer, backend), tokenizer.encode(valid), tokenizer.eos_token_id, buffer, []
            )
            for backend in ("xgrammar", "llguidance")
        }
        for backend, ok in accepted.items():
            listed = label in NARROWED.get(backend, ())
            assert listed == (not ok and any(accepted.values())), (backend, schema, accepted)
            assert any(item.endswith(f": {label}") for item in narrowed(spec, backend)) == listed
