"""A tool-calling agent loop over `tandem serve` with the official openai client.

    python examples/agent_tools.py [--base-url http://127.0.0.1:8000/v1] ["your request"]

Each turn the model reasons, then either calls one of the tools (its arguments constrained to the
tool's parameter schema by the server) or answers. Tool calls run locally (canned data: the demo
runs offline) and their results go back as `tool` messages. The last turn forbids tool calls
(`tool_choice="none"`) and constrains the answer with a JSON schema, so the loop always ends with
a schema-valid answer. Without --base-url the script starts a server in-process.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from openai import OpenAI

from tandem.demo.corpus import CURRENCY_TOOL, WEATHER_TOOL  # tools the demo models were trained to call

TOOLS = [WEATHER_TOOL, CURRENCY_TOOL]

MAX_TURNS = 3
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string", "maxLength": 80}},
    "required": ["summary"],
    "additionalProperties": False,
}

# Local implementations of the tools; they return canned data so the example needs no network.
TOOL_FUNCTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "get_weather": lambda city, unit, days: {
        "city": city,
        "unit": unit,
        "forecast": [{"day": d + 1, "high": 21 + d, "sky": "sunny"} for d in range(days)],
    },
    "convert_currency": lambda amount, from_currency, to_currency: {
        "amount": round(amount * 1.1, 2),
        "currency": to_currency,
    },
    "create_event": lambda title, date, time, attendees: {"created": True, "title": title, "when": f"{date} {time}"},
    "web_search": lambda query, max_results: {"results": [f"{query} result {i + 1}" for i in range(max_results)]},
}


def run_agent(client: OpenAI, request: str, model: str = "demo-llama") -> list[dict[str, Any]]:
    """Run the loop for one user request; returns the whole conversation, final answer last."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": request}]
    for turn in range(MAX_TURNS):
        last = turn == MAX_TURNS - 1
        response = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            temperature=0,
            max_tokens=200,
            tool_choice="none" if last else "auto",
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
        )
        message = response.choices[0].message
        print(f"[turn {turn + 1}] thinking: {(message.reasoning_content or '').strip()}")
        if not message.tool_calls:
            print(f"[turn {turn + 1}] answer: {message.content}")
            messages.append({"role": "assistant", "content": message.content})
            return messages
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call.model_dump(include={"id", "type", "function"}) for call in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            result = TOOL_FUNCTIONS[call.function.name](**json.loads(call.function.arguments))
            print(f"[turn {turn + 1}] {call.function.name}({call.function.arguments}) -> {json.dumps(result)}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    raise AssertionError("unreachable: the last turn cannot call tools")


def main(base_url: str, request: str = "Weather for Oslo, 2 days, in celsius please.") -> list[dict[str, Any]]:
    """Run the agent against the server at `base_url`; returns the conversation."""
    return run_agent(OpenAI(base_url=base_url, api_key="unused"), request)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("request", nargs="?", default=None)
    parser.add_argument("--base-url", help="a running server's /v1 URL (default: start one in-process)")
    args = parser.parse_args()
    extra = [args.request] if args.request else []
    if args.base_url:
        main(args.base_url, *extra)
    else:
        from tandem.serve.server import ServerThread, build_app

        with ServerThread(build_app("demo-llama")) as server:
            main(server.base_url, *extra)
