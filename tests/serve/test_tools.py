"""Streaming a tool call piecewise (`CallStream`): for any whitespace and any split of the answer,
the argument pieces concatenate to the model's arguments text, and non-calls send nothing."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tandem.demo.corpus import WEATHER_TOOL
from tandem.serve.protocol import ChatCompletionRequest
from tandem.serve.tools import CallStream, plan

NAMES = ["get_weather", "get_weather_now", "search"]
WHITESPACE = st.text(" \n\t", max_size=2)
ARGUMENTS = st.dictionaries(
    st.text(max_size=6),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(alphabet=' a}{",:\\\n', max_size=6),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=6,
    ),
    max_size=4,
)


@st.composite
def call_texts(draw):
    """(answer text of a call, its name, its arguments text)."""
    name = draw(st.sampled_from(NAMES))
    arguments = json.dumps(draw(ARGUMENTS), indent=draw(st.sampled_from([None, 2])), ensure_ascii=draw(st.booleans()))
    parts = ["{", '"name"', ":", json.dumps(name), ",", '"arguments"', ":", arguments, "}"]
    return "".join(draw(WHITESPACE) + part for part in parts) + draw(WHITESPACE), name, arguments


def _pieces(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _stream(pieces: list[str], complete: bool) -> tuple[CallStream, list[dict]]:
    stream = CallStream(NAMES)
    entries = [entry for piece in pieces for entry in stream.feed(piece)]
    return stream, entries + stream.finish(complete)


@given(st.data(), call_texts())
def test_a_call_streams_its_name_first_then_exactly_its_arguments(data, call):
    text, name, arguments = call
    stream, entries = _stream(_pieces(data.draw, text), complete=True)
    assert stream.is_call and all(entry["index"] == 0 for entry in entries)
    first, *rest = entries
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": name, "arguments": ""}
    assert all(set(entry) == {"index", "function"} and entry["function"]["arguments"] for entry in rest)
    assert "".join(entry["function"]["arguments"] for entry in rest) == arguments


@given(st.data(), call_texts())
def test_a_call_cut_short_sends_all_it_has(data, call):
    text, _, _ = call
    cut = text.rstrip()[:-1]  # without the call object's closing brace
    _, entries = _stream(_pieces(data.draw, cut), complete=False)
    head_end = cut.index(":", cut.index('"arguments"')) + 1
    assert "".join(entry["function"]["arguments"] for entry in entries) == cut[head_end:].strip()


@given(
    st.data(),
    st.sampled_from(
        [
            '{"label": "positive"}',
            '{"name": "get_weather"}',
            '{"name": "other", "arguments": {}}',
            '{"arguments": {}, "name": "search"}',
            '{"name": "get_weathe", "arguments": {}}',
            '["search"]',
            "search",
        ]
    ),
)
def test_answers_that_do_not_start_a_call_send_nothing(data, text):
    stream, entries = _stream(_pieces(data.draw, text), complete=True)
    assert not stream.is_call and entries == []


def test_calls_stream_only_where_a_call_shaped_answer_must_be_a_call():
    def streams(**request) -> bool:
        body = ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL], **request
        )
        return plan(body).stream_calls

    named = {"type": "function", "function": {"name": "get_weather"}}
    assert streams(tool_choice=named) and streams(tool_choice="required") and streams(tool_choice="auto")
    # A response_format schema may itself admit {"name": ..., "arguments": ...}: read it only at the end.
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    assert not streams(tool_choice="auto", response_format=answer)
    assert not streams(tool_choice="none")
