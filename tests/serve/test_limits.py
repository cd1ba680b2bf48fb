"""A server safe to expose: the API key, and every limit refused with its documented status and a
message naming the limit. One small server with tiny limits (one engine row, so a single long
request fills it) serves the whole module."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.decoding.params import SamplingParams
from tandem.grammars.spec import MAX_SCHEMA_DEPTH
from tandem.serve.config import ServeConfig
from tandem.serve.server import ServerThread, build_app
from tests.serve.conftest import MODEL

KEY = "sk-test-0123456789"
LIMITS = ServeConfig(
    max_num_seqs=1,
    graph_mode="eager",
    api_key=KEY,
    max_body_bytes=4096,
    max_new_tokens=3000,
    max_schema_bytes=600,
    max_schema_depth=8,
    max_queued_requests=1,
    queue_timeout_s=1.0,
)
HELLO = [{"role": "user", "content": "What is 7 + 5?"}]
ENDLESS = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}  # no early stop


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0, **fields}


def _error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def _nested(depth: int) -> dict:
    """An object schema whose JSON nests objects `depth` levels deep (each property level is two)."""
    schema: dict = {"type": "integer"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerThread]:
    with ServerThread(build_app(MODEL, None, LIMITS)) as running:
        yield running


@pytest.fixture(scope="module")
def http(guarded: ServerThread) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=guarded.base_url.removesuffix("/v1"), headers=headers, timeout=60) as client:
        yield client


def test_v1_routes_require_the_key_and_health_and_metrics_stay_open(guarded, http):
    with httpx.Client(base_url=guarded.base_url.removesuffix("/v1"), timeout=60) as anonymous:
        missing = _error(anonymous.get("/v1/models"), 401, "invalid_api_key")
        assert "Authorization: Bearer" in missing["message"]
        _error(anonymous.post("/v1/chat/completions", json=_chat()), 401, "invalid_api_key")
        wrong = anonymous.get("/v1/models", headers={"Authorization": f"Bearer {KEY}x"})
        assert "incorrect API key" in _error(wrong, 401, "invalid_api_key")["message"]
        assert anonymous.get("/health").status_code == 200 and anonymous.get("/metrics").status_code == 200
    assert [card["id"] for card in http.get("/v1/models").json()["data"]] == [MODEL]
    assert http.post("/v1/chat/completions", json=_chat()).status_code == 200


def test_a_body_past_the_limit_is_413(http):
    error = _error(http.post("/v1/chat/completions", json=_chat(user="x" * 5000)), 413, "request_too_large")
    assert "max_body_bytes = 4096" in error["message"]
    chunked = http.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 5000, b'"}']))  # no Content-Length
    _error(chunked, 413, "request_too_large")


def test_a_body_nested_past_what_json_parses_is_400_not_500(http):
    body = b"[" * 2000 + b"]" * 2000  # under max_body_bytes, past Python's recursion limit
    error = _error(http.post("/v1/chat/completions", content=body), 400, "invalid_json")
    assert "nested too deeply" in error["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_limit_is_400(http, field):
    error = _error(http.post("/v1/chat/completions", json=_chat(**{field: 3001})), 400, "max_tokens_exceeded")
    assert error["param"] == field and "max_new_tokens = 3000" in error["message"]


def test_a_schema_too_large_or_too_deep_is_400_naming_the_limit(http):
    big = {"type": "string", "description": "x" * 600}
    error = _error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "guided_json": big}), 400, "schema_too_large"
    )
    assert error["param"] == "guided_json" and "max_schema_bytes = 600" in error["message"]
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested(9)}}
    error = _error(
        http.post("/v1/chat/completions", json=_chat(response_format=response_format)), 400, "schema_too_deep"
    )
    assert (
        error["param"] == "response_format"
        and "9 levels" in error["message"]
        and "max_schema_depth = 8" in error["message"]
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested(9)}}
    error = _error(http.post("/v1/chat/completions", json=_chat(tools=[tool])), 400, "schema_too_deep")
    assert error["param"] == "tools.0.function.parameters"
    assert http.post("/v1/chat/completions", json=_chat(guided_json=_nested(7))).status_code == 200


def test_a_full_queue_is_429_and_a_request_waiting_past_the_timeout_is_503_and_leaves_the_engine(guarded, http):
    engine = guarded.app.state.server.llm.engine
    occupant = _chat(max_tokens=3000, stream=True, guided_json=ENDLESS)  # holds the only engine row
    waiter: dict = {}

    def wait_in_queue() -> None:
        start = time.monotonic()
        with httpx.Client(base_url=str(http.base_url), headers=http.headers, timeout=60) as own:
            waiter["response"] = own.post("/v1/chat/completions", json=_chat())
        waiter["waited_s"] = time.monotonic() - start

    with http.stream("POST", "/v1/chat/completions", json=occupant) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator would close the stream, and free the row
        next(lines)  # the first chunk: the occupant has its row
        queued = threading.Thread(target=wait_in_queue)
        queued.start()
        deadline = time.monotonic() + 10
        while guarded.app.state.server.queued < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        full = _error(http.post("/v1/chat/completions", json=_chat()), 429, "queue_full")
        assert "max_queued_requests = 1" in full["message"]
        queued.join(timeout=30)
        timeout = _error(waiter["response"], 503, "queue_timeout")
        assert "queue_timeout_s = 1" in timeout["message"] and waiter["waited_s"] >= LIMITS.queue_timeout_s
        deadline = time.monotonic() + 10
        while engine.scheduler.waiting and time.monotonic() < deadline:  # the abort lands between steps
            time.sleep(0.01)
        assert not engine.scheduler.waiting  # aborted, not left to run later
    assert http.post("/v1/chat/completions", json=_chat()).status_code == 200  # the occupant's row is free again


def test_a_schema_300_objects_deep_is_a_400_naming_the_limit_and_a_value_error_in_python(server):
    deep = _nested(601)  # 300 objects, each under the previous one's "properties"
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
    with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=60) as default_limits:
        response = default_limits.post("/v1/chat/completions", json=_chat(response_format=response_format))
    error = _error(response, 400, "schema_too_deep")
    assert (
        "601 levels" in error["message"] and f"max_schema_depth = {ServeConfig().max_schema_depth}" in error["message"]
    )
    # The Python API refuses it before any engine state changes, so asking the served LLM is safe.
    with pytest.raises(ValueError, match=f"nested 601 levels deep; at most {MAX_SCHEMA_DEPTH}"):
        server.app.state.server.llm.generate("hello", SamplingParams(json_schema=deep))


def test_metrics_scrape_with_prometheus_client_under_their_names_and_count_refusals(guarded, http):
    with httpx.Client(base_url=guarded.base_url.removesuffix("/v1"), timeout=60) as anonymous:
        anonymous.get("/v1/models")  # a 401
        text = anonymous.get("/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {
        "tandem_requests_finished",
        "tandem_requests_rejected",
        "tandem_requests_running",
        "tandem_prompt_tokens",
        "tandem_generation_tokens",
        "tandem_draft_tokens",
        "tandem_accepted_tokens",
        "tandem_request_steps",
        "tandem_mean_acceptance_length",
        "tandem_step_seconds",
    } <= set(families)
    rejected = {
        s.labels["status"]: s.value for s in families["tandem_requests_rejected"].samples if s.name.endswith("_total")
    }
    assert rejected["401"] >= 1
    assert families["tandem_step_seconds"].type == "histogram"
