"""Each example in examples/ runs (its main(), against the session server where it needs one)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import jsonschema

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_openai_client_example_returns_a_schema_valid_answer(server):
    example = _load("openai_client")
    jsonschema.validate(example.main(server.base_url), example.SCHEMA)


def test_agent_example_calls_tools_with_valid_arguments_and_answers(server):
    example = _load("agent_tools")
    conversation = example.main(server.base_url)
    calls = [call for m in conversation if m["role"] == "assistant" for call in m.get("tool_calls") or []]
    assert calls, "the agent never called a tool"
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in example.TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), parameters[call["function"]["name"]])
    results = [m for m in conversation if m["role"] == "tool"]
    assert [r["tool_call_id"] for r in results] == [call["id"] for call in calls]
    jsonschema.validate(json.loads(conversation[-1]["content"]), example.ANSWER_SCHEMA)


def test_extract_example_returns_a_valid_contact():
    example = _load("extract")
    contact = example.main()
    assert isinstance(contact, example.Contact)
    example.Contact.model_validate(contact.model_dump())
