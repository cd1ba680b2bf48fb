"""Malformed and invalid requests over raw HTTP: OpenAI error objects with the right status,
and no effect on the requests around them."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.conftest import MODEL

HELLO = [{"role": "user", "content": "What is 7 + 5?"}]


def _post(http: httpx.Client, body: dict | bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0, **fields}


def test_malformed_json_is_400(http):
    error = _error(_post(http, b'{"model": "demo-llama", "messages": ['), 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


def test_missing_field_is_named(http):
    error = _error(_post(http, {"model": MODEL}), 400)
    assert error["param"] == "messages" and error["code"] == "missing_required_parameter"


def test_wrong_type_is_named(http):
    error = _error(_post(http, _chat(temperature="hot")), 400)
    assert error["param"] == "temperature"
    error = _error(_post(http, _chat(messages=[{"role": "robot", "content": "hi"}])), 400)
    assert error["param"].startswith("messages.0.role")


def test_unknown_model_is_404(http):
    error = _error(_post(http, _chat(model="gpt-17")), 404)
    assert error["code"] == "model_not_found" and "gpt-17" in error["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("n", 99),
        ("max_tokens", 0),
        ("max_completion_tokens", -1),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("top_logprobs", 21),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
    ],
)
def test_out_of_range_param_is_named(http, field, value):
    error = _error(_post(http, _chat(**{field: value})), 400)
    assert error["param"] == field


@pytest.mark.parametrize("value", [{"17": 101}, {"x": 1}, {"-3": 1}])
def test_a_bad_logit_bias_entry_is_named(http, value):
    error = _error(_post(http, _chat(logit_bias=value)), 400)
    assert error["param"].startswith("logit_bias")


@pytest.mark.parametrize("field, value", [("best_of", 2), ("suffix", "x")])
def test_a_sampling_field_tandem_does_not_implement_is_refused_by_name(http, field, value):
    error = _error(_post(http, _chat(**{field: value})), 400)
    assert error["param"] == field and error["code"] == "unsupported_parameter" and field in error["message"]


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "repetition_penalty"])
def test_penalties_change_the_output(http, field):
    reference = _post(http, _chat(max_tokens=24)).json()["choices"][0]["message"]
    penalized = _post(http, _chat(max_tokens=24, **{field: 2.0})).json()["choices"][0]["message"]
    assert penalized != reference


def test_logit_bias_forces_a_token_and_an_id_outside_the_vocabulary_is_refused(http):
    completion = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    forced = _post(http, {**completion, "logit_bias": {"40": 100}}, "/v1/completions").json()
    assert forced["choices"][0]["text"] == "AAA"  # token 40 is "A"
    error = _error(_post(http, {**completion, "logit_bias": {"99999": 1}}, "/v1/completions"), 400)
    assert "logit_bias" in error["message"] and "99999" in error["message"] and "vocabulary" in error["message"]


def test_prompt_token_ids_outside_the_vocabulary_are_refused_and_the_server_goes_on(http):
    completion = {"model": MODEL, "prompt": [1, 2, 99999], "max_tokens": 2}
    error = _error(_post(http, completion, "/v1/completions"), 400)
    assert "prompt: token id 99999 is outside the vocabulary" in error["message"]
    assert _post(http, {**completion, "prompt": [1, 2, 3]}, "/v1/completions").status_code == 200


def test_unimplemented_fields_at_their_neutral_values_and_unknown_fields_are_accepted(http):
    neutral = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "best_of": 1,
        "user": "u-1",
        "parallel_tool_calls": True,
        "x_vendor_extension": [1],
    }
    assert _post(http, _chat(**neutral)).status_code == 200
    completion = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "echo": False, "best_of": 1}
    assert _post(http, completion, "/v1/completions").status_code == 200
    error = _error(_post(http, {**completion, "echo": True}, "/v1/completions"), 400)
    assert error["param"] == "echo"


def test_top_logprobs_needs_logprobs(http):
    error = _error(_post(http, _chat(top_logprobs=2)), 400)
    assert error["param"] == "top_logprobs" and "logprobs: true" in error["message"]


def test_invalid_schema_names_its_location(http):
    response_format = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "integr"}}}
    error = _error(_post(http, _chat(response_format=response_format)), 400)
    assert error["param"] == "response_format" and error["code"] == "invalid_schema"
    assert "/type" in error["message"]


def test_unsupported_schema_keyword_is_named(http):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    response_format = {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema}}
    error = _error(_post(http, _chat(response_format=response_format)), 400)
    assert error["code"] == "unsupported_schema" and "uniqueItems" in error["message"]


def test_invalid_tool_parameters_are_blamed_on_tools(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}
    error = _error(_post(http, _chat(tools=[tool], tool_choice="required")), 400)
    assert error["param"] == "tools" and error["code"] == "invalid_schema"


def test_tool_choice_must_name_an_offered_tool(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    choice = {"type": "function", "function": {"name": "g"}}
    error = _error(_post(http, _chat(tools=[tool], tool_choice=choice)), 400)
    assert error["param"] == "tool_choice" and "'g'" in error["message"]


def test_prompt_longer_than_the_context_is_400(http):
    long = [{"role": "user", "content": "word " * 5000}]
    error = _error(_post(http, _chat(messages=long)), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    error = _error(_post(http, {"model": MODEL, "prompt": "hello", "max_tokens": 100_000}, "/v1/completions"), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


def test_unknown_route_is_an_error_object(http):
    _error(http.get("/v1/nothing"), 404)


def test_bad_request_between_good_ones_leaves_them_intact(http):
    good = _chat(max_tokens=24)
    bad = _chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
        }
    )
    reference = _post(http, good).json()["choices"][0]["message"]
    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda body: _post(http, body), [good, bad, good, b"{", good]))
    assert [r.status_code for r in results] == [200, 400, 200, 400, 200]
    for response in results[::2]:
        assert response.json()["choices"][0]["message"] == reference


def _metric(http: httpx.Client, line_prefix: str) -> float:
    text = http.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_prefix))


def test_client_disconnect_mid_stream_frees_the_request(server):
    with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=60) as http:
        aborted = _metric(http, 'tandem_requests_finished_total{finish_reason="abort"}')
        endless = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}  # no early stop
        body = _chat(
            max_tokens=2000,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": endless}},
        )
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            first = next(response.iter_lines())
            assert re.match(r"data: \{", first)
        deadline = time.monotonic() + 10
        while _metric(http, "tandem_requests_running") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(http, "tandem_requests_running") == 0
        assert _metric(http, 'tandem_requests_finished_total{finish_reason="abort"}') == aborted + 1


def test_ignore_eos_runs_to_max_tokens_and_is_refused_with_a_schema(http):
    completion = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    assert _post(http, completion, "/v1/completions").json()["usage"]["completion_tokens"] == 40
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    error = _error(_post(http, _chat(ignore_eos=True, response_format=schema)), 400)
    assert "ignore_eos" in error["message"]
