"""GrammarSpec construction: every kind, and clear errors that say what and where."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from tandem.grammars.errors import InvalidGrammarSpec
from tandem.grammars.spec import GrammarSpec, escape_regex_literal


class Point(BaseModel):
    x: int
    y: int


def test_json_schema_from_dict_text_and_pydantic_are_equal():
    schema = Point.model_json_schema()
    assert GrammarSpec.json_schema(Point) == GrammarSpec.json_schema(schema)
    assert GrammarSpec.json_schema(Point).schema == schema
    import json

    assert GrammarSpec.json_schema(json.dumps(schema)) == GrammarSpec.json_schema(schema)
    assert hash(GrammarSpec.json_schema(schema)) == hash(GrammarSpec.json_schema(Point))


def test_invalid_subschema_error_names_its_json_pointer():
    bad = {"type": "object", "properties": {"age": {"type": "integer", "minimum": "zero"}}}
    with pytest.raises(
        InvalidGrammarSpec, match=r"json_schema at /properties/age/minimum: 'zero' is not of type 'number'"
    ):
        GrammarSpec.json_schema(bad)


def test_invalid_json_text_error_names_line_and_column():
    with pytest.raises(InvalidGrammarSpec, match="not valid JSON at line 1 column 10"):
        GrammarSpec.json_schema('{"type": }')


def test_non_schema_values_are_rejected():
    with pytest.raises(InvalidGrammarSpec, match="must be an object or a boolean, got list"):
        GrammarSpec.json_schema([1, 2])
    with pytest.raises(InvalidGrammarSpec, match="int is not a pydantic model class"):
        GrammarSpec.json_schema(int)


def test_bad_regex_names_position():
    with pytest.raises(InvalidGrammarSpec, match=r"regex: missing \), unterminated subpattern at position 0"):
        GrammarSpec.regex("(ab")


def test_bad_lark_and_ebnf_carry_the_parser_message():
    with pytest.raises(InvalidGrammarSpec, match="lark: .*unknown name"):
        GrammarSpec.lark("start: foo")
    with pytest.raises(InvalidGrammarSpec, match="ebnf: .*"):
        GrammarSpec.ebnf("root ::= undefined_rule")
    assert GrammarSpec.lark('start: "a" | "b"').kind == "lark"
    assert GrammarSpec.ebnf('root ::= "a" | "b"').kind == "ebnf"


@pytest.mark.parametrize(
    "options, message",
    [
        ([], "non-empty list"),
        ("yes", "non-empty list"),
        (["a", 1], "choice at /1: expected a string"),
        (["a", "a"], "distinct"),
    ],
)
def test_bad_choices(options, message):
    with pytest.raises(InvalidGrammarSpec, match=message):
        GrammarSpec.choice(options)


def test_choice_regex_matches_each_option_literally():
    import re

    options = ["a.b", "(x|y)*", "1+1=2", "path/to\\file", "[]{}^$?-"]
    pattern = re.compile(GrammarSpec.choice(options).as_regex)
    for option in options:
        assert pattern.fullmatch(option)
    assert not pattern.fullmatch("aXb")
    assert escape_regex_literal("a.b") == r"a\.b"
