"""Draft-aware normalisation: every rewrite accepts exactly the instances the original accepts."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tandem.grammars.normalize import DRAFTS, normalize, schema_validator
from tests.grammars.conftest import MASKBENCH

URIS = {
    "draft-04": "http://json-schema.org/draft-04/schema#",
    "draft-06": "http://json-schema.org/draft-06/schema#",
    "draft-07": "http://json-schema.org/draft-07/schema#",
    "2019-09": "https://json-schema.org/draft/2019-09/schema",
}
NAMES = ["a", "b", "c"]
TYPES = ["null", "boolean", "integer", "number", "string", "array", "object"]
BOUNDS = ["minimum", "maximum"]

# Instances: no integral floats (draft-04 does not count 1.0 as an integer, later drafts do, and no
# grammar emits "1.0" for an integer).
instances = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.sampled_from([-1.5, 0.5, 2.5])
    | st.sampled_from(["", "x", "yy"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(NAMES), inner, max_size=3),
    max_leaves=8,
)


def leaves(draft: str):
    bound = st.integers(-3, 3)
    numeric = st.builds(lambda b, kw: {kw: b}, bound, st.sampled_from(BOUNDS))
    if draft == "draft-04":  # the boolean exclusive bounds
        numeric |= st.builds(
            lambda b, e, kw: {kw: b, f"exclusive{kw.title()}": e},
            bound,
            st.booleans(),
            st.sampled_from(BOUNDS),
        )
    else:
        numeric |= st.builds(lambda b, kw: {kw: b}, bound, st.sampled_from(["exclusiveMinimum", "exclusiveMaximum"]))
    refs = ["#/definitions/d0", "#/definitions/d1", "d1.json", "#d2"]
    if draft == "draft-04":
        refs = refs[:3]
    return (
        st.builds(lambda t: {"type": t}, st.sampled_from(TYPES))
        | st.builds(lambda v: {"enum": v}, st.lists(instances, min_size=1, max_size=3))
        | st.builds(lambda v: {"const": v}, instances)  # draft-04 does not define `const`: ignored there
        | numeric
        | st.builds(lambda r, t: {"$ref": r, "type": t}, st.sampled_from(refs), st.sampled_from(["string", "integer"]))
        | st.builds(lambda n: {"required": n}, st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True))
        | st.just(True)
        | st.just(False)
    )


def composites(draft: str, inner):
    def tuple_items(items, more):
        return {"items": items} if more is None else {"items": items, "additionalItems": more}

    return (
        st.builds(tuple_items, st.lists(inner, min_size=1, max_size=2), st.none() | inner)
        | st.builds(lambda s: {"items": s}, inner)
        | st.builds(lambda s: {"additionalItems": s}, inner)  # ignored without an array `items`
        | st.builds(lambda p: {"properties": p}, st.dictionaries(st.sampled_from(NAMES), inner, max_size=2))
        | st.builds(
            lambda d: {"dependencies": d},
            st.dictionaries(st.sampled_from(NAMES), inner | st.lists(st.sampled_from(NAMES), max_size=2), max_size=2),
        )
        | st.builds(lambda s: {"anyOf": s}, st.lists(inner, min_size=1, max_size=2))
        | st.builds(lambda s: {"allOf": s}, st.lists(inner, min_size=1, max_size=2))
        | st.builds(lambda s: {"not": s}, inner)
        | st.builds(lambda a, b: {**a, **b} if isinstance(a, dict) and isinstance(b, dict) else a, inner, inner)
    )


@st.composite
def drafted_schemas(draft):
    draft_name = draft(st.sampled_from(sorted(URIS)))
    body = draft(st.recursive(leaves(draft_name), lambda inner: composites(draft_name, inner), max_leaves=6))
    definitions = {
        "d0": draft(leaves(draft_name).filter(lambda s: not isinstance(s, dict) or "$ref" not in s)),
        "d1": {"id" if draft_name == "draft-04" else "$id": "d1.json", "type": "integer", "maximum": 2},
    }
    if draft_name != "draft-04":
        anchor = {"$anchor": "d2"} if draft_name == "2019-09" else {"$id": "#d2"}  # drafts 6 and 7 name anchors by $id
        definitions["d2"] = {**anchor, "type": "string"}
    root = {"$schema": URIS[draft_name], "id" if draft_name == "draft-04" else "$id": "http://t.invalid/root.json",
            "definitions": definitions}  # fmt: skip
    root.update(body if isinstance(body, dict) else {"not": {}} if body is False else {})
    return draft_name, root


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(drafted_schemas(), st.lists(instances, min_size=1, max_size=8))
def test_rewrite_to_2020_12_accepts_exactly_what_the_original_draft_accepts(drafted, data):
    draft, schema = drafted
    assume(DRAFTS[draft](DRAFTS[draft].META_SCHEMA).is_valid(schema))
    original = DRAFTS[draft](schema)
    rewritten, problems = normalize(schema)
    assert problems == []
    jsonschema.Draft202012Validator.check_schema(rewritten)
    assert "definitions" not in json.dumps(rewritten) and '"id"' not in json.dumps(rewritten)
    converted = jsonschema.Draft202012Validator(rewritten)
    for instance in data:
        assert original.is_valid(instance) == converted.is_valid(instance), (schema, rewritten, instance)


def test_forms_are_rewritten_to_2020_12():
    schema = {
        "$schema": URIS["draft-04"],
        "definitions": {"pos": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}},
        "properties": {
            "a": {"$ref": "#/definitions/pos", "type": "string"},
            "t": {"items": [{"type": "string"}], "additionalItems": False},
        },
        "dependencies": {"a": ["t"], "t": {"required": ["b"]}},
    }
    assert normalize(schema) == (
        {
            "$defs": {"pos": {"type": "integer", "exclusiveMinimum": 0}},
            "properties": {"a": {"$ref": "#/$defs/pos"}, "t": {"prefixItems": [{"type": "string"}], "items": False}},
            "dependentRequired": {"a": ["t"]},
            "dependentSchemas": {"t": {"required": ["b"]}},
        },
        [],
    )


def test_refs_resolve_against_id_base_uris_and_anchors():
    schema = {
        "$id": "http://example.com/root.json",
        "$defs": {"A": {"$id": "nested/a.json", "$defs": {"B": {"$anchor": "bee", "type": "null"}}, "$ref": "#bee"}},
        "properties": {"x": {"$ref": "nested/a.json"}, "y": {"$ref": "http://example.com/nested/a.json#/$defs/B"}},
    }
    rewritten, problems = normalize(schema)
    assert problems == []
    assert rewritten["$defs"]["A"]["$ref"] == "#/$defs/A/$defs/B"
    assert rewritten["properties"] == {"x": {"$ref": "#/$defs/A"}, "y": {"$ref": "#/$defs/A/$defs/B"}}


def test_ref_targets_outside_schema_keywords_move_into_defs():
    schema = {"properties": {"a": {"$ref": "#/components/x"}}, "components": {"x": {"type": "string"}}}
    rewritten, _ = normalize(schema)
    target = rewritten["properties"]["a"]["$ref"]
    assert target.startswith("#/$defs/") and rewritten["$defs"][target.split("/")[-1]] == {"type": "string"}


def test_remote_refs_are_reported_with_their_url():
    _, problems = normalize({"properties": {"a": {"$ref": "https://example.com/s.json#/x"}}})
    assert problems == [
        "/properties/a/$ref: $ref https://example.com/s.json#/x is remote (https://example.com/s.json): "
        "remote schemas are not fetched"
    ]


def test_draft_03_is_reported_not_rewritten():
    schema = {"$schema": "http://json-schema.org/draft-03/schema#", "properties": {"a": {"required": True}}}
    assert normalize(schema) == (schema, ["/$schema: http://json-schema.org/draft-03/schema# is not supported "
                                          "(drafts 4 to 2020-12 are)"])  # fmt: skip


def test_draft_is_inferred_from_legacy_forms_without_schema_keyword():
    assert schema_validator({"type": "object"}) is jsonschema.Draft202012Validator
    assert schema_validator({"properties": {"a": {"dependencies": {"b": ["c"]}}}}) is jsonschema.Draft7Validator
    assert schema_validator({"maximum": 3, "exclusiveMaximum": True}) is jsonschema.Draft4Validator
    # a property *named* dependencies is no legacy form
    assert schema_validator({"properties": {"dependencies": {"type": "object"}}}) is jsonschema.Draft202012Validator


def _has_integral_float(data) -> bool:
    if isinstance(data, float):
        return data.is_integer()
    values = data.values() if isinstance(data, dict) else data if isinstance(data, list) else ()
    return any(map(_has_integral_float, values))


LEGACY_WORDS = ('"$schema"', '"definitions"', '"dependencies"', '"additionalItems"', '"items": [', '"id"', "true")


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason=f"MaskBench not at {MASKBENCH}")
def test_maskbench_instances_keep_their_validity_through_the_rewrite():
    """Every MaskBench schema the rewrite changes: its instances validate as before (12345.0 for a
    draft-04 integer aside, see `instances`)."""
    checked = 0
    for path in sorted(MASKBENCH.glob("*.json")):
        case = json.loads(path.read_text())
        source = json.dumps(case["schema"])
        if not case["tests"] or not isinstance(case["schema"], dict) or not any(w in source for w in LEGACY_WORDS):
            continue
        validator = schema_validator(case["schema"])
        rewritten, problems = normalize(case["schema"])
        if problems or rewritten == case["schema"]:
            continue
        original, converted = validator(case["schema"]), jsonschema.Draft202012Validator(rewritten)
        for test in case["tests"]:
            if validator is jsonschema.Draft4Validator and _has_integral_float(test["data"]):
                continue
            assert converted.is_valid(test["data"]) == original.is_valid(test["data"]), path.name
            checked += 1
    assert checked > 1000
