"""Tool calling: the JSON schema a tool call must follow, and reading calls back out of answers.

The chat templates tandem targets (the demo models', Llama 3.1's JSON format) call a tool by
answering with one JSON object `{"name": <tool name>, "arguments": {...}}`. The answer is
constrained per `tool_choice`:

- a named function: exactly a call of that function, arguments following its `parameters`;
- `required`: a call of any offered tool (`anyOf` of the calls);
- `auto`: a call of any tool, or an ordinary answer — the request's JSON schema (`response_format`,
  `structured_outputs.json`, ...) if one is given, else any JSON object without an `arguments` key
  (so that whatever has the shape of a call is a valid call); a regex, choice or grammar
  constraint cannot be combined with tool calls, which are JSON;
- `none` (or no tools): only the request's own constraint applies, and the answer is never read as a call.

Streamed, a call's arguments arrive piecewise as the model writes them (`CallStream`), once the
answer's text has started a call and nothing else can start that way.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.serve.errors import invalid
from tandem.serve.protocol import ChatCompletionRequest, Constraint, NamedToolChoice, Tool

ANY_PLAIN_ANSWER = {"type": "object", "properties": {"arguments": False}}  # any object that is not call-shaped


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's answer is constrained to, and whether to read it as a tool call."""

    constraint: Constraint | None  # what the answer must match; None = free text
    tools: list[Tool]  # the tools an answer may call (empty: never read as a call)
    # Whether an answer that starts like a call is one, so that a stream may send it piecewise
    # (not when a response_format schema could also admit call-shaped objects).
    stream_calls: bool = False


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
    answer = request.constraint()
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice requires tools", param="tool_choice")
        return ToolPlan(answer, [])
    if choice == "none":
        return ToolPlan(answer, [])
    if answer is not None and answer.kind != "json_schema":
        raise invalid(
            f"{answer.param} cannot be combined with tool calls (JSON): give a JSON schema or tool_choice none",
            param=answer.param,
        )
    if isinstance(choice, NamedToolChoice):
        named = [tool for tool in tools if tool.function.name == choice.function.name]
        if not named:
            offered = [tool.function.name for tool in tools]
            raise invalid(
                f"tool_choice names function {choice.function.name!r}, which is not among tools {offered}",
                param="tool_choice",
            )
        return ToolPlan(Constraint("json_schema", call_schema(named[0]), "tools"), named, stream_calls=True)
    calls = [call_schema(tool) for tool in tools]
    if choice == "required":
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return ToolPlan(Constraint("json_schema", schema, "tools"), tools, stream_calls=True)
    plain = ANY_PLAIN_ANSWER if answer is None else answer.value
    return ToolPlan(Constraint("json_schema", {"anyOf": [*calls, plain]}, "tools"), tools, stream_calls=answer is None)


def parse_call(answer: str, tools: list[Tool]) -> dict[str, Any] | None:
    """The OpenAI `tool_calls` entry for an answer that is a call of one of `tools`, else None.

    `arguments` comes back as JSON text, as OpenAI returns it.
    """
    try:
        call = json.loads(answer)
    except json.JSONDecodeError:
        return None
    names = {tool.function.name for tool in tools}
    if not (
        isinstance(call, dict)
        and set(call) == {"name", "arguments"}
        and call["name"] in names
        and isinstance(call["arguments"], dict)
    ):
        return None
    return {
        "id": _new_call_id(),
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
    }


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallStream:
    """One streamed answer read as a tool call: the OpenAI `tool_calls` delta entries to send.

    The answer is a call once its text starts `{"name": "<offered tool>", "arguments":` (compared
    without whitespace; tool names have none). From then on the arguments' text is sent as it
    comes, less any trailing `}` and whitespace, which may be the call object's own end; `finish`
    sends the rest. Concatenated, the argument pieces are the model's arguments text exactly.
    """

    def __init__(self, tool_names: Iterable[str]):
        self._heads = {f'{{"name":"{name}","arguments":': name for name in tool_names}
        self._longest_head = max(map(len, self._heads), default=0)
        self._text = ""
        self._args_start: int | None = None  # where the arguments start in the text, once a call
        self._sent = 0  # characters of the (left-stripped) arguments sent

    @property
    def is_call(self) -> bool:
        return self._args_start is not None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The entries that the answer's next piece `text` makes ready (often none)."""
        self._text += text
        entries = [] if self.is_call else self._start()
        if self.is_call:
            args = self._arguments()
            entries += self._send(args[: len(args.rstrip("} \t\n\r"))])
        return entries

    def finish(self, complete: bool) -> list[dict[str, Any]]:
        """The last entries of a call: the arguments' unsent rest; `complete` (the answer ended with
        the call object's `}`, not cut short) drops that final `}`. Nothing for an answer that is no call."""
        if not self.is_call:
            return []
        args = self._arguments().rstrip()
        if complete and args.endswith("}"):
            args = args[:-1].rstrip()
        return self._send(args)

    def _start(self) -> list[dict[str, Any]]:
        """The call's first entry (id, name) if the text has just completed a call's head."""
        compact = ""  # the text so far without whitespace, up to the longest head
        for end, char in enumerate(self._text):
            if char.isspace():
                continue
            compact += char
            if compact in self._heads:
                self._args_start = end + 1
                return [
                    {
                        "index": 0,
                        "id": _new_call_id(),
                        "type": "function",
                        "function": {"name": self._heads[compact], "arguments": ""},
                    }
                ]
            if len(compact) >= self._longest_head:
                break
        return []

    def _arguments(self) -> str:
        return self._text[self._args_start :].lstrip()

    def _send(self, ready: str) -> list[dict[str, Any]]:
        if len(ready) <= self._sent:
            return []
        piece, self._sent = ready[self._sent :], len(ready)
        return [{"index": 0, "function": {"arguments": piece}}]
