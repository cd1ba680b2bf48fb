"""The structured-output fields vLLM users send (`structured_outputs`, `guided_*`) constrain the
answer, on chat and text completions, and leave the reasoning free; conflicting or malformed ones are 400."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.serve.conftest import MODEL

HELLO = [{"role": "user", "content": "What is 7 + 5?"}]
CODE = "[a-z]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma"]
NUMBER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def _answer(http: httpx.Client, path: str = "/v1/chat/completions", **fields) -> str:
    if path.endswith("chat/completions"):
        body = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 120, **fields}
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["message"]["reasoning_content"]  # the model still reasons, unconstrained
        return choice["message"]["content"]
    response = http.post(
        path, json={"model": MODEL, "prompt": "The code is", "temperature": 0, "max_tokens": 30, **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_regex_constrains_the_answer(http, path):
    assert not re.fullmatch(CODE, _answer(http, path))  # what the model answers when free
    assert re.fullmatch(CODE, _answer(http, path, structured_outputs={"regex": CODE}))
    assert re.fullmatch(CODE, _answer(http, path, guided_regex=CODE))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_choice_answers_one_of_the_choices(http, path):
    assert _answer(http, path, structured_outputs={"choice": CHOICES}) in CHOICES
    assert _answer(http, path, guided_choice=CHOICES) in CHOICES


def test_a_grammar_is_read_as_gbnf_or_as_lark(http):
    assert re.fullmatch("x[0-9]{2}", _answer(http, structured_outputs={"grammar": 'root ::= "x" [0-9] [0-9]'}))
    assert re.fullmatch("y[0-9]{2}", _answer(http, guided_grammar='start: "y" DIGIT DIGIT\nDIGIT: /[0-9]/'))


def test_a_json_schema_constrains_the_answer_given_as_an_object_or_as_text(http):
    jsonschema.validate(json.loads(_answer(http, structured_outputs={"json": NUMBER})), NUMBER)
    jsonschema.validate(json.loads(_answer(http, guided_json=json.dumps(NUMBER))), NUMBER)


@pytest.mark.parametrize(
    "fields, first, second",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "guided_regex"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.regex",
            "structured_outputs.choice",
        ),
    ],
)
def test_two_constraints_are_400_naming_both(http, fields, first, second):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "conflicting_constraints" and error["param"] == second
    assert first in error["message"] and second in error["message"]


def test_a_grammar_in_neither_dialect_is_400_naming_both(http):
    body = {"model": MODEL, "prompt": "hi", "structured_outputs": {"grammar": "root ::= 'a"}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.grammar" and error["code"] == "invalid_grammar"
    assert (
        "neither GBNF/EBNF nor Lark" in error["message"] and "ebnf:" in error["message"] and "lark:" in error["message"]
    )


def test_a_regex_with_tool_calls_is_400(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": MODEL, "messages": HELLO, "tools": [tool], "tool_choice": "required", "guided_regex": "a"}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex", response.text


def test_a_json_schema_given_as_text_that_is_not_json_is_400(http):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "guided_json": "{type"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        error["param"] == "guided_json" and error["code"] == "invalid_schema" and "not valid JSON" in error["message"]
    )
