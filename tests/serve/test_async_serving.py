"""`tandem serve --async-scheduling`: a plain model's server answers, whole and streamed, with and without a JSON
schema, as the synchronous one does (the engine thread's steps report a step's tokens one step later)."""

from __future__ import annotations

import json

import jsonschema
from openai import OpenAI

from tandem.demo.corpus import CONTACT_SCHEMA
from tandem.serve.server import ServerThread, build_app
from tests.serve.conftest import MODEL
from tests.serve.test_chat import CONTACT


def _answers(client: OpenAI) -> list[tuple]:
    messages = CONTACT
    schema = {"type": "json_schema", "json_schema": {"name": "contact", "schema": CONTACT_SCHEMA}}
    whole = [
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0, **extra)
        for extra in ({}, {"response_format": schema})
    ]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return [(r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) for r in whole] + [
        streamed
    ]


def test_an_async_scheduled_server_answers_as_the_synchronous_one():
    answers, overlapped = {}, {}
    for overlap in (False, True):
        app = build_app(MODEL, None, async_scheduling=overlap)
        with ServerThread(app) as server:
            answers[overlap] = _answers(OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60))
        overlapped[overlap] = app.state.server.llm.engine.overlapped_steps
    assert answers[True] == answers[False]
    assert overlapped[False] == 0 and overlapped[True] > 100
    content, reason, _ = answers[True][1]
    assert reason == "stop"
    jsonschema.validate(json.loads(content), CONTACT_SCHEMA)
