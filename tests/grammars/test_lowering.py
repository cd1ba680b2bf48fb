"""Exact rewrites (lowering.py): disjoint oneOf as anyOf, filtered enums, `not` of a type,
`uniqueItems` on short arrays, formats as patterns; each keeps what validates."""

from __future__ import annotations

import json
from typing import Literal, Union

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from tandem.cli.eval_schemas import instance_text, walk_instance
from tandem.core.bitmask import bitmask_width
from tandem.grammars.compiler import compile_grammar
from tandem.grammars.errors import GrammarError
from tandem.grammars.formats import format_pattern
from tandem.grammars.lowering import lower_source
from tandem.grammars.spec import GrammarSpec


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Union[Cat, Dog] = Field(discriminator="kind")  # noqa: UP007 (pydantic's documented spelling)


def lower(schema, native_formats=frozenset()):
    source, problems = lower_source(json.dumps(schema), frozenset(native_formats))
    assert problems == ()
    return json.loads(source)


DISJOINT_ONE_OFS = [
    {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "array"}]},
    {"oneOf": [{"const": 0}, {"const": 1}, {"enum": ["a", None]}]},
    Pet.model_json_schema(),  # pydantic's discriminated union: $refs to objects with a `kind` const
    {"type": "object", "oneOf": [  # a tag required in one branch, enum values differing
        {"properties": {"t": {"enum": ["a", "b"]}, "x": {"type": "integer"}}, "required": ["t"]},
        {"properties": {"t": {"enum": ["c"]}}},
    ]},
    {"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}, "required": ["t"]},
               {"type": "object", "allOf": [{"properties": {"t": {"const": 2}}}]}]},
]  # fmt: skip

OVERLAPPING_ONE_OFS = [  # no proof, and a branch has no complement (`not integer`)
    {"oneOf": [{"required": ["radius"]}, {"properties": {"t": {"type": "integer"}}}]},  # both may hold
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # 1 is both
]

COMPLEMENTED_ONE_OFS = [  # spelled out with complements (test_negation.py), or proven disjoint since
    {"oneOf": [{"properties": {"t": {"const": "a"}}}, {"properties": {"t": {"const": "b"}}}]},  # {} is both
    {"oneOf": [  # tag required, values differ; a non-object matches both, so fails the oneOf
        {"properties": {"t": {"const": "a"}}, "required": ["t"]},
        {"properties": {"t": {"const": "b"}}, "required": ["t"]},
    ]},
    {"oneOf": [{"const": 1}, {"const": 1.0}]},  # equal numbers: each branch with the other's complement, never
    {"oneOf": [{"const": [1]}, {"const": [2]}]},  # jsonschema finds [1] fails the other branch
]  # fmt: skip

OTHER_REWRITES = [  # (schema, what the rewrite leaves)
    ({"type": ["string", "integer"], "not": {"type": "string"}}, {"type": "integer"}),
    ({"not": {"type": ["number", "null"]}}, {"type": ["boolean", "object", "array", "string"]}),
    ({"type": "number", "not": {"type": "integer"}}, None),  # "a non-integer number" has no type: kept
    ({"not": {}}, False),
    ({"type": "array", "uniqueItems": True, "maxItems": 1}, {"type": "array", "maxItems": 1}),
    ({"type": "array", "uniqueItems": True, "maxItems": 2}, None),
    ({"allOf": [{"enum": [1, 2, 3]}, {"not": {"const": 2}}]}, {"enum": [1, 3]}),
    ({"type": "boolean", "not": {"const": True}}, {"enum": [False]}),
    ({"type": "string", "format": "non-blank"}, {"type": "string"}),  # not a JSON Schema format
    ({"enum": ["x", "a@b"], "format": "email"}, {"enum": ["a@b"]}),  # formats asserted
    ({"enum": ["x", "2024-01-01T00:00:00Z"], "format": "date-time"},  # unchecked here: kept, format as pattern
     {"enum": ["x", "2024-01-01T00:00:00Z"], "pattern": format_pattern("date-time")}),
    ({"not": {"required": ["t"]}}, {"allOf": [{"type": "object", "properties": {"t": False}}]}),
    ({"not": {"required": ["t", "x"]}},
     {"allOf": [{"type": "object", "anyOf": [{"properties": {"t": False}}, {"properties": {"x": False}}]}]}),
    ({"oneOf": [{"required": ["radius"]}, {"required": ["t", "x"]}, {"required": ["t"]}]}, {"anyOf": [
        {"type": "object", "required": ["radius"], "allOf": [{"anyOf": [{"properties": {"t": False}},
                                                                         {"properties": {"x": False}}]},
                                                              {"anyOf": [{"properties": {"t": False}}]}]},
        {"type": "object", "required": ["t"], "allOf": [{"anyOf": [{"properties": {"radius": False}}]},
                                                         {"anyOf": [{"properties": {"x": False}}]}]},
    ]}),  # {t, x} never holds alone: {t} holds with it
    ({"dependentRequired": {"t": ["x", "radius"], "x": []}},
     {"allOf": [{"anyOf": [{"properties": {"t": False}}, {"required": ["x", "radius"]}]}]}),
    ({"allOf": [{"type": "object"}], "dependentRequired": {"x": ["t"]},
      "dependentSchemas": {"t": {"properties": {"x": {"type": "integer"}}, "required": ["x", "t"]}, "x": True,
                           "radius": False}},
     {"allOf": [{"type": "object"}, {"anyOf": [{"properties": {"x": False}}, {"required": ["t"]}]},
                {"anyOf": [{"properties": {"t": False}},
                           {"properties": {"x": {"type": "integer"}}, "required": ["t", "x"], "type": "object"}]},
                {"anyOf": [{"properties": {"radius": False}}, False]}]}),
    # A oneOf tagged by the dependency's own property: disjoint once the property is known present.
    ({"dependentSchemas": {"kind": {"oneOf": [{"properties": {"kind": {"const": "a"}, "x": {"maximum": 0}}},
                                              {"properties": {"kind": {"const": "b"}, "x": {"minimum": 2}}}]}}},
     {"allOf": [{"anyOf": [{"properties": {"kind": False}}, {"type": "object", "required": ["kind"], "anyOf": [
         {"properties": {"kind": {"const": "a"}, "x": {"maximum": 0}}},
         {"properties": {"kind": {"const": "b"}, "x": {"minimum": 2}}}]}]}]}),
]  # fmt: skip

SCHEMAS = DISJOINT_ONE_OFS + OVERLAPPING_ONE_OFS + COMPLEMENTED_ONE_OFS + [schema for schema, _ in OTHER_REWRITES]
instances = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([0.5, 1.0, "a", "b", "c", "cat", "dog", "x", "a@b"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["t", "x", "kind", "lives", "good", "pet", "radius"]), inner, max_size=3)
    ),
    max_leaves=6,
)


@pytest.mark.parametrize("schema", DISJOINT_ONE_OFS, ids=range(len(DISJOINT_ONE_OFS)))
def test_provably_disjoint_one_of_becomes_any_of(schema):
    text = json.dumps(lower(schema))
    assert '"oneOf"' not in text and '"anyOf"' in text


@pytest.mark.parametrize("schema", OVERLAPPING_ONE_OFS, ids=range(len(OVERLAPPING_ONE_OFS)))
def test_one_of_without_a_disjointness_proof_stays(schema):
    assert lower(schema) == schema


@pytest.mark.parametrize("schema", COMPLEMENTED_ONE_OFS, ids=range(len(COMPLEMENTED_ONE_OFS)))
def test_overlapping_one_of_with_complements_becomes_any_of(schema):
    assert '"oneOf"' not in json.dumps(lower(schema))


@pytest.mark.parametrize("schema, expected", OTHER_REWRITES, ids=range(len(OTHER_REWRITES)))
def test_cheap_exact_rewrites(schema, expected):
    assert lower(schema) == (schema if expected is None else expected)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(SCHEMAS), st.lists(instances, min_size=1, max_size=10))
def test_rewrites_accept_exactly_what_the_schema_accepts(schema, data):
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER  # formats asserted, as the backends do
    original = jsonschema.Draft202012Validator(schema, format_checker=checker)
    rewritten = jsonschema.Draft202012Validator(lower(schema), format_checker=checker)
    for instance in data:
        assert original.is_valid(instance) == rewritten.is_valid(instance), (schema, instance)


def test_formats_become_patterns_only_where_the_backend_lacks_them():
    schema = {"type": "string", "format": "date", "pattern": "^2"}
    assert lower(schema, {"date"}) == schema
    lowered = lower(schema)
    assert lowered["pattern"] == "^2" and lowered["allOf"][0]["pattern"].startswith("^(")
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for text in ["2024-02-29", "2023-02-29", "1999-01-01", "2x"]:
        assert not jsonschema.Draft202012Validator(lowered).is_valid(text) or checker.is_valid(text), text


def test_discriminated_union_compiles_strict_and_rejects_a_wrong_tag(tokenizer):
    compiled = compile_grammar(GrammarSpec.json_schema(Pet), tokenizer)
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)

    def accepts(data) -> bool:
        return walk_instance(compiled, tokenizer.encode(instance_text(data)), tokenizer.eos_token_id, buffer, [])

    assert accepts({"pet": {"kind": "cat", "lives": 9}}) and accepts({"pet": {"kind": "dog", "good": True}})
    assert not accepts({"pet": {"kind": "cow", "lives": 9}}) and not accepts({"pet": {"kind": "cat", "good": True}})


def test_overlapping_one_of_is_still_refused_naming_its_pointer(tokenizer):
    with pytest.raises(GrammarError, match="/properties/d/oneOf"):
        compile_grammar(GrammarSpec.json_schema({"properties": {"d": OVERLAPPING_ONE_OFS[0]}}), tokenizer)


def test_not_required_rewrite_compiles_and_holds(tokenizer):
    """MaskBench Github_trivial---o91408: `not: {required}` failed on llguidance and was dropped by
    outlines-core; rewritten, llguidance enforces it (outlines-core still refuses it strict)."""
    schema = {"type": "object", "properties": {"body": {"type": "string"}, "bodyValue": {"type": "string"}},
              "not": {"required": ["body", "bodyValue"]}}  # fmt: skip
    compiled = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, "llguidance")
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    for text, valid in [('{"body":"a","bodyValue":"b"}', False), ('{"body":"a"}', True), ("{}", True)]:
        assert walk_instance(compiled, tokenizer.encode(text), tokenizer.eos_token_id, buffer, []) == valid, text
    with pytest.raises(GrammarError, match="properties"):
        compile_grammar(GrammarSpec.json_schema(schema), tokenizer, "outlines")


def test_dependent_schemas_compile_and_hold(tokenizer):
    """MaskBench Glaiveai2K---calculate_area (`dependencies` of a tagged `oneOf`) failed on every backend."""
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b"]}, "x": {"type": "integer"}},
        "dependentSchemas": {
            "kind": {
                "oneOf": [
                    {"properties": {"kind": {"const": "a"}, "x": {"maximum": 3}}},
                    {"properties": {"kind": {"const": "b"}, "x": {"minimum": 10}}},
                ]
            }
        },
    }
    compiled = compile_grammar(GrammarSpec.json_schema(schema), tokenizer)
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    validator = jsonschema.Draft202012Validator(schema)
    for data in [
        {"kind": "a", "x": 2},
        {"kind": "a", "x": 12},
        {"kind": "b", "x": 12},
        {"kind": "b", "x": 5},
        {"x": 50},
    ]:
        walked = walk_instance(compiled, tokenizer.encode(instance_text(data)), tokenizer.eos_token_id, buffer, [])
        assert walked == validator.is_valid(data), data
