"""Complements (lowering.py `negate`): `not`, `if`/`then`/`else`, `contains` and overlapping `oneOf`
rewritten without the keyword, accepting exactly what the original accepts (jsonschema on both;
llguidance's masks on the rewrite), and left alone where no complement exists."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.cli.eval_schemas import instance_text, walk_instance
from tandem.core.bitmask import bitmask_width
from tandem.grammars.compiler import compile_grammar
from tandem.grammars.errors import GrammarError
from tandem.grammars.lowering import lower_source
from tandem.grammars.patterns import literal_prefix, pattern_complement, strings_excluded
from tandem.grammars.spec import GrammarSpec
from tests.grammars.conftest import SCHEMA_SUITE


def lower(schema):
    source, problems = lower_source(json.dumps(schema))
    assert problems == ()
    return json.loads(source)


WORDS = ["", "a", "ab", "abc", "b", "ba", "a.b", "a\\b", "é", "\t"]
REWRITTEN = [  # the rewrite leaves none of the keyword (named first)
    ("not", {"not": {"enum": ["ab", "a", 2, None, True]}}),
    ("not", {"type": "string", "minLength": 1, "not": {"enum": ["a.b", "é", "\t", ""]}}),  # MaskBench o25761
    ("not", {"not": {"type": "string", "enum": ["ab", "ba"]}}),  # o35866
    ("not", {"not": {"const": 1.5}}),
    ("not", {"not": {"enum": [False, None]}}),
    ("not", {"not": {"pattern": "^a[bc]\\."}}),
    ("not", {"not": {"pattern": "^[^a]"}}),
    ("not", {"not": {"pattern": "[ab]"}}),
    ("not", {"not": {"anyOf": [{"minimum": 3}, {"type": "string", "maxLength": 1}]}}),
    ("not", {"not": {"allOf": [{"exclusiveMaximum": 2}, {"type": "number"}]}}),
    ("not", {"not": {"properties": {"t": {"type": "string"}, "x": {"minItems": 2}}, "required": ["t"]}}),  # o21864
    ("not", {"not": {"not": {"type": "array", "maxItems": 1}}}),
    ("not", {"not": {"$ref": "#/$defs/s"}, "$defs": {"s": {"type": "object", "minProperties": 2}}}),
    ("not", {"not": {"minLength": 0}}),
    ("not", {"not": {"minLength": 2}}),
    ("not", {"not": {"maxItems": 1, "minProperties": 1}}),
    ("not", {"not": {"exclusiveMinimum": 1, "maximum": 4}}),
    ("not", {"type": "object", "not": {"propertyNames": {"not": {"enum": ["t", "xx"], "maxLength": 1}}}}),  # pnmp1
    ("not", {"not": {"propertyNames": False}}),  # MaskBench Handwritten---pNameFalse
    ("if", {"type": "object", "properties": {"t": {"enum": ["a", "b"]}},  # MaskBench o4834
            "if": {"properties": {"t": {"const": "a"}}}, "then": {"required": ["x"]}, "else": {"required": ["t"]}}),
    ("if", {"if": {"type": "string"}, "then": {"minLength": 2}}),
    ("if", {"if": {"maximum": 0}, "else": {"multipleOf": 2}}),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"type": "integer"}}),
    ("contains", {"type": "array", "maxItems": 3, "contains": {"const": "a"}}),
    ("contains", {"contains": {"type": "string"}, "minContains": 0}),
    ("contains", {"contains": {"description": "any"}}),
    ("oneOf", {"type": "object", "oneOf": [{"properties": {"t": {"type": "string"}}, "required": ["t"]},  # o42159
                                           {"properties": {"x": {"type": "string"}}, "required": ["x"]}]}),
    ("oneOf", {"oneOf": [{"properties": {"t": {"const": "a"}}}, {"properties": {"t": {"const": "b"}}}]}),
    ("oneOf", {"oneOf": [{"maximum": 2}, {"maximum": 5}]}),  # o81530
    ("oneOf", {"oneOf": [{"type": "string"}, {"enum": ["a", 1]}]}),
    ("oneOf", {"type": "object", "oneOf": [  # o74185: closed objects, the complement within the other's names
        {"properties": {"t": {"type": "string"}}, "additionalProperties": False},
        {"properties": {"x": {"type": "integer"}}, "additionalProperties": False},
    ]}),
]  # fmt: skip

DISJOINT = [  # proven disjoint: plain anyOf, no complement needed
    {"oneOf": [{"type": "string", "pattern": "^https?://"}, {"type": "string", "pattern": "^\\./"}]},  # o90216
    {"oneOf": [{"type": "string", "pattern": "^#[0-9a-f]{6}$"}, {"enum": ["red", "blue", 3]}]},  # o37786
    {"oneOf": [{"additionalProperties": False, "properties": {"t": {}}, "required": ["t"]},  # o51159
               {"additionalProperties": False, "properties": {"t": {}, "x": {}}, "required": ["t", "x"]}]},
    {"oneOf": [{"properties": {"x": False}}, {"required": ["x"]}]},
]  # fmt: skip

KEPT = [  # no complement: the keyword stays (and is refused downstream)
    ("not", {"not": {"multipleOf": 3}}),
    ("not", {"not": {"type": "integer"}}),  # "a number but not an integer" has no type
    ("not", {"not": {"items": {"type": "string"}}}),
    ("not", {"not": {"pattern": "a+"}}),
    ("not", {"not": {"pattern": "[^ab]"}}),  # matches a newline: Python's `$` would differ
    ("not", {"not": {"enum": [[1]]}}),
    ("not", {"not": {"enum": ["a\nb"]}}),
    ("not", {"not": {"patternProperties": {"a": False}}}),
    ("not", {"not": {"additionalProperties": False}}),  # "some undeclared name" has no keyword
    ("not", {"not": {"propertyNames": {"maxLength": 1}}}),  # "a name of 2 characters or more"
    ("not", {"not": {"$ref": "#/$defs/n"}, "$defs": {"n": {"required": ["t"], "properties": {  # recursive
        "t": {"$ref": "#/$defs/n"}, "x": {"$ref": "#/$defs/n"}, "y": {"$ref": "#/$defs/n"}}}}}),
    ("if", {"if": {"multipleOf": 2}, "then": {"minimum": 0}}),
    ("contains", {"type": "array", "contains": {"const": 1}}),
    ("contains", {"type": "array", "maxItems": 3, "contains": {"const": 1}, "minContains": 2}),
    ("oneOf", {"oneOf": [{"type": "string"}, {"pattern": "a+"}]}),
    ("oneOf", {"oneOf": [{"properties": {"t": {"items": {"type": "string"}}}}, {"required": ["t"]}]}),
]  # fmt: skip

instances = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from([-1, 0, 1, 1.5, 2, 2.0, 3, 4, 5, 6])
    | st.sampled_from(WORDS + ["a.", "a.c", "abc.", "ac.", "http://x", "./x", "#00ff00", "red"])
    | st.text(alphabet="ab.\\é\t\n", max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["t", "x", "y", "xx"]), inner, max_size=3)
    ),
    max_leaves=6,
)
ALL = [schema for _, schema in REWRITTEN] + DISJOINT + [schema for _, schema in KEPT]


@pytest.mark.parametrize("keyword, schema", REWRITTEN, ids=range(len(REWRITTEN)))
def test_rewritten_without_the_keyword(keyword, schema):
    assert f'"{keyword}"' not in json.dumps(lower(schema))


@pytest.mark.parametrize("schema", DISJOINT, ids=range(len(DISJOINT)))
def test_disjoint_one_of_becomes_a_plain_any_of(schema):
    text = json.dumps(lower(schema))
    assert "oneOf" not in text and "anyOf" in text and "allOf" not in text  # no complement was needed


@pytest.mark.parametrize("keyword, schema", KEPT, ids=range(len(KEPT)))
def test_kept_where_no_complement_exists(keyword, schema):
    assert f'"{keyword}"' in json.dumps(lower(schema))


FIXED_INSTANCES = [
    *WORDS, "a.", "a.c", "ac.", "http://x", "./x", "red", "a\n", None, True, False, -1, 0, 1, 1.5, 2, 2.0, 3, 4, 4.5,
    [], ["a"], ["b", "a"], [1, 2], {}, {"t": "a"}, {"t": 1}, {"x": 1}, {"t": "a", "x": 1}, {"xx": 1}, {"y": []},
]  # fmt: skip


@pytest.mark.parametrize("schema", ALL, ids=range(len(ALL)))
def test_rewrites_give_every_fixed_instance_its_verdict(schema):
    original, rewritten = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(lower(schema))
    assert [original.is_valid(x) for x in FIXED_INSTANCES] == [rewritten.is_valid(x) for x in FIXED_INSTANCES]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(ALL), st.lists(instances, min_size=1, max_size=10))
def test_rewrites_accept_exactly_what_the_schema_accepts(schema, data):
    original = jsonschema.Draft202012Validator(schema)
    rewritten = jsonschema.Draft202012Validator(lower(schema))
    for instance in data:
        assert original.is_valid(instance) == rewritten.is_valid(instance), (schema, instance)


def _keyword(keys: list[str], values: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(st.sampled_from(keys), values).map(lambda kv: {kv[0]: kv[1]})


NAMES = ["t", "x", "y", "xx"]
_scalars = st.sampled_from([None, True, False, 0, 1, 2, 1.5, "", "a", "ab", "t", "xx"])
_leaves = st.booleans() | st.one_of(
    _keyword(["type"], st.sampled_from(["null", "boolean", "object", "array", "string", "number", "integer"])),
    _keyword(["type"], st.lists(st.sampled_from(["string", "number", "integer", "object"]), min_size=1, unique=True)),
    _keyword(["enum"], st.lists(_scalars, min_size=1, max_size=3)),
    _keyword(["const"], _scalars),
    _keyword(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"], st.sampled_from([0, 1, 1.5])),
    _keyword(["minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"], st.integers(0, 2)),
    _keyword(["pattern"], st.sampled_from(["^a", "^ab", "[ab]", "^[^a]x", "a+", ""])),
    _keyword(["required"], st.lists(st.sampled_from(NAMES), max_size=2, unique=True)),
    _keyword(["multipleOf"], st.just(2)),
)
random_schemas = st.recursive(  # keyword by keyword, nested through every keyword lowering rewrites
    _leaves,
    lambda inner: st.one_of(
        _keyword(["not", "items", "propertyNames"], inner),
        _keyword(["anyOf", "allOf", "oneOf"], st.lists(inner, min_size=1, max_size=3)),
        st.fixed_dictionaries({"if": inner}, optional={"then": inner, "else": inner}),
        st.fixed_dictionaries({"properties": st.dictionaries(st.sampled_from(NAMES), inner, max_size=2)},
                              optional={"additionalProperties": st.booleans()}),
        st.fixed_dictionaries({"contains": inner},
                              optional={"maxItems": st.integers(0, 3), "minContains": st.integers(0, 2)}),
        st.tuples(inner, inner).map(lambda ab: {**ab[0], **ab[1]} if all(isinstance(x, dict) for x in ab) else ab[0]),
    ),
    max_leaves=6,
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(random_schemas, st.lists(instances, min_size=1, max_size=8))
def test_random_schemas_keep_every_verdict(schema, data):
    """Each random schema, and its `not` (every shape through `negate`)."""
    for tried in ({"allOf": [schema]}, {"not": schema}):
        original, rewritten = jsonschema.Draft202012Validator(tried), jsonschema.Draft202012Validator(lower(tried))
        for instance in data:
            assert original.is_valid(instance) == rewritten.is_valid(instance), (tried, instance)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4), st.text(alphabet="abc.\\é\t\n", max_size=5))
def test_excluded_strings_pattern_matches_every_other_string(words, text):
    pattern = strings_excluded(words)["pattern"]
    assert (re.search(pattern, text) is not None) == (text not in words), (words, text)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["^a", "^ab\\.", "^[ab]c", "^[^a]b", "^\\[x", "[ab]", "[.]", "^", ""]),
       st.text(alphabet="abcx.[\n", max_size=5))  # fmt: skip
def testpattern_complement_holds_exactly_where_the_pattern_does_not_match(pattern, text):
    complement = pattern_complement(pattern)
    holds = complement is not False and jsonschema.Draft202012Validator(complement).is_valid(text)
    assert holds == (re.search(pattern, text) is None), (pattern, text)


def testliteral_prefix_stops_before_quantifiers_and_gives_up_on_alternation():
    assert literal_prefix("^https?://.+$") == "http"
    assert literal_prefix("^\\./x") == "./x"
    assert literal_prefix("^#[0-9]") == "#"
    assert literal_prefix("^a|b") is None and literal_prefix("ab") is None and literal_prefix("^a*") is None


@pytest.mark.parametrize(
    "keyword, schema",
    [
        ("not", {"enum": ["x", "2024-01-01"], "not": {"format": "date"}}),
        ("not", {"not": {"type": "string", "format": "time"}}),
        ("if", {"if": {"format": "date"}, "then": {"minLength": 20}}),
        ("oneOf", {"oneOf": [{"enum": ["2024-13-01"]}, {"type": "string", "format": "date"}]}),
    ],
)
def test_a_format_pattern_is_never_complemented(keyword, schema):
    """A format becomes a pattern that accepts a subset of it (formats.py); its complement would
    accept a valid string of the format (a leap second, a year past 9999), so it stays refused."""
    assert f'"{keyword}"' in json.dumps(lower(schema))


def test_complement_of_a_complement_is_the_schema_it_came_from():
    """MaskBench o35866: a `not: {enum}` branch of a oneOf, itself negated for the other branches."""
    schema = {"type": "object", "oneOf": [
        {"properties": {"c": {"type": "string", "enum": ["CAN"]}, "s": {"enum": ["AB"]}}},
        {"properties": {"c": {"not": {"type": "string", "enum": ["CAN", "MEX"]}}, "s": {"type": "string"}}},
    ]}  # fmt: skip
    assert "oneOf" not in json.dumps(lower(schema)) and '"not"' not in json.dumps(lower(schema))


def walker(tokenizer, schema):
    compiled = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, "llguidance")
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    return lambda data: walk_instance(
        compiled, tokenizer.encode(instance_text(data)), tokenizer.eos_token_id, buffer, []
    )


MASK_CASES = [  # (schema, instances): llguidance reads the rewrite's regexes and bounds as jsonschema does
    (
        {"type": "string", "not": {"enum": ["a.b", "é", "\t", ""]}},
        ["a.b", "a.", "ab", "é", "éé", "\t", "\t\t", "", "x"],
    ),
    ({"not": {"enum": ["ab", "a", 2, None, True]}}, ["ab", "a", "abc", "", 2, 2.5, 1, None, True, False, [], {}]),
    ({"not": {"enum": ["a", ""]}}, ["a", "a\n", "\n", "\n\n", "b", ""]),  # `$` ends the text, newline or not
    ({"not": {"pattern": "^a[bc]\\."}}, ["a", "ab.", "ac.", "ab", "ac.x", "b", "", 3]),
    ({"not": {"pattern": "[ab]"}}, ["xyz", "xaz", "", "b", 1]),
    ({"not": {"maximum": 2, "minLength": 2}}, [2, 3, 2.5, "a", "ab", None]),
    (REWRITTEN[19][1], [{"t": "a", "x": 1}, {"t": "a"}, {"t": "b"}, {"x": 1}, {}]),
    ({"type": "array", "maxItems": 3, "contains": {"const": "a"}}, [["a"], ["b", "a"], ["b", "b", "a"], ["b"], []]),
    (REWRITTEN[26][1], [{"t": "1"}, {"x": "1"}, {"t": "1", "x": "2"}, {}]),
    (REWRITTEN[-1][1], [{"t": "1"}, {"x": 1}, {"t": "1", "x": 2}, {}, {"y": 1}]),
    (DISJOINT[0], ["http://a", "https://a", "./a", "ftp://a"]),
]


@pytest.mark.parametrize("schema, data", MASK_CASES, ids=range(len(MASK_CASES)))
def test_llguidance_masks_accept_exactly_the_valid_instances(tokenizer, schema, data):
    accepts, validator = walker(tokenizer, schema), jsonschema.Draft202012Validator(schema)
    assert [accepts(d) for d in data] == [validator.is_valid(d) for d in data]


def test_a_not_without_complement_is_refused_naming_its_pointer(tokenizer):
    with pytest.raises(GrammarError, match="/properties/a/not"):
        compile_grammar(GrammarSpec.json_schema({"properties": {"a": {"not": {"multipleOf": 3}}}}), tokenizer)


SUITE_FILES = ["not", "oneOf", "if-then-else", "contains"]


@pytest.mark.skipif(not SCHEMA_SUITE.is_dir(), reason=f"JSON-Schema-Test-Suite not at {SCHEMA_SUITE}")
@pytest.mark.parametrize("name", SUITE_FILES)
def test_suite_cases_of_the_keyword_hold_after_the_rewrite_and_through_the_masks(name, tokenizer):
    """Every test of the keyword's suite file: jsonschema on the rewritten schema gives the suite's
    verdict; where the schema compiles strict (auto), the masks give it too."""
    compiled = 0
    for group in json.loads((SCHEMA_SUITE / f"{name}.json").read_text()):
        rewritten = jsonschema.Draft202012Validator(lower(group["schema"]))
        for test in group["tests"]:
            assert rewritten.is_valid(test["data"]) == test["valid"], (group["description"], test["description"])
        try:
            grammar = compile_grammar(GrammarSpec.json_schema(group["schema"]), tokenizer)
        except GrammarError:
            continue
        compiled += 1
        buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
        for test in group["tests"]:
            tokens = tokenizer.encode(instance_text(test["data"]))
            walked = walk_instance(grammar, tokens, tokenizer.eos_token_id, buffer, [])
            assert test["valid"] or not walked, (group["description"], test["description"])
    assert compiled > 0
