"""Chat and text completions through the official openai client, against a real server."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from tandem.demo.corpus import CONTACT_SCHEMA, SEARCH_TOOL, TOOLS, WEATHER_TOOL
from tandem.llm import best_draft, resolve_model
from tests.serve.conftest import MODEL

ARITHMETIC = [{"role": "user", "content": "What is 7 + 5?"}]
CONTACT = [
    {
        "role": "user",
        "content": "Extract the contact details from this text: Bob Smith is 33 years old "
        "and lives in Rome. You can reach them at bob.smith@mail.com.",
    }
]
WEATHER = [{"role": "user", "content": "What will the weather be in Paris over the next 3 days? Use celsius."}]


def _chat(client: OpenAI, messages=ARITHMETIC, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 16, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_health_is_ok(http):
    assert http.get("/health").json() == {"status": "ok"}


def test_reasoning_and_answer_are_split(client):
    response = _chat(client, max_tokens=60)
    message = response.choices[0].message
    assert message.reasoning_content and message.reasoning == message.reasoning_content
    assert "<think>" not in message.reasoning_content and "</think>" not in message.content
    assert message.content.startswith("{")


def test_usage_counts_prompt_and_generated_tokens(client, server):
    response = _chat(client, max_tokens=8)
    llm = server.app.state.server.llm
    assert response.usage.prompt_tokens == len(llm.chat_prompt(ARITHMETIC))
    assert response.usage.completion_tokens == 8  # the first tokens are reasoning: no early stop
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8
    assert response.choices[0].finish_reason == "length"


def test_speculative_stats_ride_in_their_own_field(client):
    stats = _chat(client, max_tokens=12).speculative_decoding
    assert stats["draft"] == best_draft(resolve_model(MODEL)) and stats["num_speculative_tokens"] == 4
    assert 1 <= stats["steps"] <= 12 and 0 <= stats["accepted"] <= stats["drafted"]
    assert stats["mean_accepted_length"] == pytest.approx(
        (stats["accepted"] + stats["steps"]) / stats["steps"], abs=1e-3
    )


def test_json_schema_answer_is_valid(client):
    response = _chat(
        client,
        CONTACT,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "contact", "schema": CONTACT_SCHEMA}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.reasoning_content  # the schema applies to the answer only
    jsonschema.validate(json.loads(choice.message.content), CONTACT_SCHEMA)


def test_json_object_answer_is_an_object(client):
    response = _chat(client, max_tokens=80, response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_streaming_matches_non_streaming(client):
    whole = _chat(client, max_tokens=40)
    chunks = list(_chat(client, max_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (whole.choices[0].message.reasoning_content, whole.choices[0].message.content)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert chunks[-1].speculative_decoding["steps"] >= 1


def test_chat_logprobs_cover_every_token_streamed_or_not(client):
    whole = _chat(client, max_tokens=24, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:  # greedy: the token is the most likely one, and the top three are sorted
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    message = whole.choices[0].message
    assert "".join(entry.token for entry in content).endswith(message.content)
    chunks = list(_chat(client, max_tokens=24, logprobs=True, top_logprobs=3, stream=True))
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    # Same tokens; log-probabilities equal up to float rounding, as between speculative and plain decoding
    # (adaptive speculation may verify the two requests' tokens in steps of different widths).
    tokens = lambda entries: [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in entries]  # noqa: E731
    values = lambda entries: [v for e in entries for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]  # noqa: E731
    assert tokens(streamed) == tokens(content)
    assert values(streamed) == pytest.approx(values(content), abs=1e-4, rel=0)
    assert _chat(client, max_tokens=4).choices[0].logprobs is None


def test_n_choices_with_one_seed_are_reproducible(client):
    kwargs = {"temperature": 1.0, "seed": 1234, "max_tokens": 12}
    first, second = _chat(client, n=3, **kwargs), _chat(client, n=3, **kwargs)
    texts = [c.message.reasoning_content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.reasoning_content for c in second.choices]
    assert len(set(texts)) > 1  # derived seeds differ per choice
    assert _chat(client, **kwargs).choices[0].message.reasoning_content == texts[0]  # choice 0 uses the seed itself
    assert first.usage.completion_tokens == 3 * 12


def test_stop_string_ends_the_answer(client):
    response = _chat(client, CONTACT, max_tokens=120, stop=['"age"'])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content.endswith(", ")  # cut right before the stop string


def test_named_tool_call_follows_the_tool_schema(client):
    response = _chat(
        client,
        WEATHER,
        max_tokens=80,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_required_tool_call_picks_an_offered_tool(client):
    offered = [WEATHER_TOOL, SEARCH_TOOL]
    response = _chat(client, WEATHER, max_tokens=80, tools=offered, tool_choice="required")
    (call,) = response.choices[0].message.tool_calls
    tool = {t["function"]["name"]: t for t in offered}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_auto_tool_choice_returns_a_valid_call_or_an_answer(client):
    response = _chat(client, WEATHER, max_tokens=200, tools=TOOLS, tool_choice="auto")
    choice = response.choices[0]
    assert choice.finish_reason in ("tool_calls", "stop")
    if choice.finish_reason == "tool_calls":
        (call,) = choice.message.tool_calls
        tool = {t["function"]["name"]: t for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    else:
        assert "arguments" not in json.loads(choice.message.content)


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_a_streamed_tool_call_arrives_piecewise_and_equals_the_unstreamed_one(client, tool_choice):
    request = {"messages": WEATHER, "max_tokens": 80, "tools": [WEATHER_TOOL], "tool_choice": tool_choice}
    (whole,) = _chat(client, **request).choices[0].message.tool_calls
    chunks = list(_chat(client, **request, stream=True))
    entries = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    first, *pieces = entries
    assert first.id.startswith("call_") and first.function.name == "get_weather" and first.function.arguments == ""
    assert len(pieces) > 3 and all(piece.id is None and piece.function.name is None for piece in pieces)
    arguments = "".join(piece.function.arguments for piece in pieces)
    assert json.loads(arguments) == json.loads(whole.function.arguments)
    assert all(chunk.choices[0].delta.content in (None, "") for chunk in chunks if chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_continue_the_conversation(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 3}'},
    }
    messages = [
        *WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 21 C"}'},
    ]
    response = _chat(client, messages, max_tokens=8, tools=[WEATHER_TOOL])
    assert response.usage.completion_tokens == 8


def test_text_completion_batch_gives_a_choice_per_prompt(client):
    response = client.completions.create(
        model=MODEL, prompt=["The weather in", "Contact:"], max_tokens=5, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 10


def test_text_completion_streams(client):
    whole = client.completions.create(model=MODEL, prompt="The weather in", max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(model=MODEL, prompt="The weather in", max_tokens=6, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_text_completion_logprobs_streamed_or_not(client):
    request = {"model": MODEL, "prompt": "The weather in", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**request).choices[0]
    logprobs = whole.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(
        len(top) == 2 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs)
    )
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
    chunks = list(client.completions.create(**request, stream=True))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((p.tokens for p in pieces), []) == logprobs.tokens
    assert sum((p.text_offset for p in pieces), []) == logprobs.text_offset


def test_metrics_count_requests_and_tokens(client, http):
    def value(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    before = http.get("/metrics").text
    _chat(client, max_tokens=5)
    after = http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    assert value(after.text, "tandem_generation_tokens_total") - value(before, "tandem_generation_tokens_total") == 5
    assert (
        value(after.text, 'tandem_requests_finished_total{finish_reason="length"}')
        == value(before, 'tandem_requests_finished_total{finish_reason="length"}') + 1
    )
    assert value(after.text, "tandem_step_seconds_count") > value(before, "tandem_step_seconds_count")
    assert "tandem_draft_tokens_total" in after.text and "tandem_mean_acceptance_length" in after.text


def test_a_repeated_prompt_reports_its_cached_tokens_in_usage_and_metrics(client, http):
    """The server's engine caches prefixes (block size 16): a second request with the same long prompt is served
    its full blocks from the cache, says so in `usage.prompt_tokens_details.cached_tokens`, and /metrics counts it."""

    def value(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    question = "List three facts about the sea, the sky and the mountains. " * 6
    messages = [{"role": "user", "content": question}]
    before = http.get("/metrics").text
    first = client.chat.completions.create(model="demo-llama", messages=messages, max_tokens=3, temperature=0)
    second = client.chat.completions.create(model="demo-llama", messages=messages, max_tokens=3, temperature=0)
    after = http.get("/metrics").text
    prompt = second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == prompt > 64
    assert cached == prompt // 16 * 16 or cached == (prompt - 1) // 16 * 16  # its full blocks
    assert second.choices[0].message.content == first.choices[0].message.content
    assert (
        value(after, "tandem_prefix_cache_hit_tokens_total") - value(before, "tandem_prefix_cache_hit_tokens_total")
        >= cached
    )
    assert value(after, 'tandem_kv_blocks{state="total"}') > 0
