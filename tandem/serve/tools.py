"""Tool calling: the JSON schema a tool call must follow, and reading calls back out of answers.

The chat templates tandem targets (the demo models', Llama 3.1's JSON format) call a tool by
answering with one JSON object `{"name": <tool name>, "arguments": {...}}`. The answer is
constrained per `tool_choice`:

- a named function: exactly a call of that function, arguments following its `parameters`;
- `required`: a call of any offered tool (`anyOf` of the calls);
- `auto`: a call of any tool, or an ordinary answer — the `response_format` schema if one is
  given, else any JSON object without an `arguments` key (so that whatever has the shape of a
  call is a valid call);
- `none` (or no tools): only `response_format` applies, and the answer is never read as a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tandem.serve.errors import invalid
from tandem.serve.protocol import ChatCompletionRequest, NamedToolChoice, Tool

ANY_PLAIN_ANSWER = {"type": "object", "properties": {"arguments": False}}  # any object that is not call-shaped


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's answer is constrained to, and whether to read it as a tool call."""

    schema: dict[str, Any] | bool | None  # the answer's JSON schema; None = free text
    schema_param: str  # the request field the schema came from, for error messages
    tools: list[Tool]  # the tools an answer may call (empty: never read as a call)


def call_schema(tool: Tool) -> dict[str, Any]:
    """`{"name": <const>, "arguments": <the tool's parameters>}`, nothing else."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def plan(request: ChatCompletionRequest) -> ToolPlan:
    """The answer constraint of a chat request (see the module docstring); raises a 400 APIError
    for a tool_choice naming a tool that is not offered, or tool_choice without tools."""
    tools, choice = request.tools or [], request.tool_choice
    answer_schema = request.output_schema()
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice requires tools", param="tool_choice")
        return ToolPlan(answer_schema, "response_format", [])
    if choice == "none":
        return ToolPlan(answer_schema, "response_format", [])
    if isinstance(choice, NamedToolChoice):
        named = [tool for tool in tools if tool.function.name == choice.function.name]
        if not named:
            offered = [tool.function.name for tool in tools]
            raise invalid(f"tool_choice names function {choice.function.name!r}, which is not among tools {offered}",
                          param="tool_choice")
        return ToolPlan(call_schema(named[0]), "tools", named)
    calls = [call_schema(tool) for tool in tools]
    if choice == "required":
        return ToolPlan(calls[0] if len(calls) == 1 else {"anyOf": calls}, "tools", tools)
    plain = ANY_PLAIN_ANSWER if answer_schema is None else answer_schema
    return ToolPlan({"anyOf": [*calls, plain]}, "tools", tools)


def parse_call(answer: str, tools: list[Tool]) -> dict[str, Any] | None:
    """The OpenAI `tool_calls` entry for an answer that is a call of one of `tools`, else None.

    `arguments` comes back as JSON text, as OpenAI returns it.
    """
    try:
        call = json.loads(answer)
    except json.JSONDecodeError:
        return None
    names = {tool.function.name for tool in tools}
    if not (isinstance(call, dict) and set(call) == {"name", "arguments"} and call["name"] in names
            and isinstance(call["arguments"], dict)):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
