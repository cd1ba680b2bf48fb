"""Bounded load run of `tandem serve` on loopback: concurrent streaming clients, every answer checked.

Starts the server in-process on 127.0.0.1 (a free port), then CLIENTS asyncio clients share
REQUESTS streaming chat requests drawn from the demo corpus's held-out prompts. Free strings of
every schema are capped at MAX_STRING characters (the tiny demo models, decoding greedily,
sometimes repeat inside a string until max_tokens; a cap is what a production schema would carry,
and it makes every answer end). Workloads:

- `schema` (default): independent requests, each with its task family's JSON schema as `response_format`;
- `agent`: multi-turn conversations, TURNS requests each, as an agent sends them: every turn resends
  the system prompt, the tool definitions and the conversation so far (earlier answers, tool calls
  and their canned results) plus a new user message, so consecutive turns share ever longer prefixes
  (what prefix caching saves). The model may call a tool (arguments checked against its parameters)
  or answer with AGENT_ANSWER.

Stops after the last request or DEADLINE_S, whichever comes first, and prints one JSON object:
requests, errors (HTTP failures, unfinished or schema-invalid answers), p50/p99 latency and time to
first token, prompt and completion tokens, and completion tokens/s.

    python benchmarks/serve_load.py [--workload schema|agent] [--clients 32] [--requests 96] [--deadline-s 60]
        [--no-prefix-caching]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import jsonschema
from openai import AsyncOpenAI

from tandem.demo.corpus import TASK_FAMILIES, TOOLS, generate_examples
from tandem.serve.server import ServerThread, build_app

MODEL = "demo-llama"
MAX_TOKENS = 512
MAX_STRING = 64
TURNS = 4  # requests per agent conversation
AGENT_SYSTEM = (
    "You are a travel and office assistant. Use the tools for weather forecasts, currency conversion, "
    "calendar events and web searches when they help; otherwise answer with a short summary. Keep answers brief."
)


def bounded(schema: Any) -> Any:
    """`schema` with `maxLength: MAX_STRING` on every string subschema that has no maxLength, enum or const."""
    if isinstance(schema, list):
        return [bounded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded(value) for key, value in schema.items()}
    if out.get("type") == "string" and not {"maxLength", "enum", "const"} & set(out):
        out["maxLength"] = MAX_STRING
    return out


AGENT_TOOLS = bounded(TOOLS)
AGENT_ANSWER = bounded({"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]})


async def _chat(client: AsyncOpenAI, results: list[dict], label: str, **request: Any) -> dict | None:
    """One streaming chat request, checked: a tool call's arguments against the tool's parameters,
    an answer against the request's schema. Appends {latency_s, ttft_s, prompt_tokens, tokens, error}
    to `results`; returns the assistant message (None on an error)."""
    schema = request["response_format"]["json_schema"]["schema"]
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in request.get("tools", [])}
    start, first, content, calls, usage, error = time.perf_counter(), None, "", {}, None, None
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **request,
        )
        finish = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                first = first or time.perf_counter()
                content += choice.delta.content or ""
                for part in choice.delta.tool_calls or []:  # a call's id and name come first, its arguments piecewise
                    call = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
                finish = choice.finish_reason or finish
        if finish not in ("stop", "tool_calls"):
            tokens = usage.completion_tokens if usage else "?"
            error = f"finish_reason {finish!r} after {tokens} tokens ({len(content)} answer characters)"
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), parameters[call["name"]])
        if not calls and not error:
            jsonschema.validate(json.loads(content), schema)
    except Exception as e:  # every failure counts as an error of this request
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    results.append(
        {
            "latency_s": end - start,
            "ttft_s": (first or end) - start,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "tokens": usage.completion_tokens if usage else 0,
            "error": error and f"{label}: {error}",
        }
    )
    if error:
        return None
    tool_calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()
    ]
    return {"role": "assistant", "content": content or None, **({"tool_calls": tool_calls} if tool_calls else {})}


def schema_requests(requests: int) -> list[Callable[[AsyncOpenAI, list[dict]], Awaitable[None]]]:
    """The `schema` workload: one request per held-out example, under its family's schema."""

    async def one(example, client: AsyncOpenAI, results: list[dict]) -> None:
        schema = bounded(TASK_FAMILIES[example.family].schema)
        response_format = {"type": "json_schema", "json_schema": {"name": example.family, "schema": schema}}
        await _chat(client, results, example.family, messages=example.messages, response_format=response_format)

    return [functools.partial(one, example) for example in generate_examples(requests, seed=1, split="heldout")]


def agent_conversations(requests: int, turns: int) -> list[Callable[[AsyncOpenAI, list[dict]], Awaitable[None]]]:
    """The `agent` workload: ceil(requests / turns) conversations of `turns` requests each; turn t adds
    the t-th of the conversation's held-out user messages to everything sent before (and answered)."""
    conversations = -(-requests // turns)
    examples = generate_examples(conversations * turns, seed=1, split="heldout")
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": AGENT_ANSWER}}

    async def converse(users: list[str], client: AsyncOpenAI, results: list[dict]) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": AGENT_SYSTEM}]
        for turn, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            reply = await _chat(
                client,
                results,
                f"turn {turn + 1}",
                messages=messages,
                tools=AGENT_TOOLS,
                response_format=response_format,
            )
            if reply is None:
                return
            messages.append(reply)
            for call in reply.get("tool_calls", []):  # canned results: the benchmark measures the server
                result = {"ok": True, "result": f"{call['function']['name']} done"}
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})

    users = [example.messages[-1]["content"] for example in examples]
    return [functools.partial(converse, users[i : i + turns]) for i in range(0, len(users), turns)]


async def _load(base_url: str, clients: int, jobs: list, deadline_s: float) -> dict:
    """Run `jobs` (each a request or a conversation) on `clients` concurrent clients until done or the deadline."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    results: list[dict] = []
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=deadline_s)

    async def worker() -> None:
        while not queue.empty():
            await queue.get_nowait()(client, results)

    start = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), timeout=deadline_s)
        stopped = "all requests done"
    except asyncio.TimeoutError:
        stopped = f"deadline of {deadline_s:g} s"
    wall = time.perf_counter() - start
    await client.close()
    latencies = sorted(r["latency_s"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results)
    errors = [r["error"] for r in results if r["error"]]
    quantile = lambda values, q: round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None  # noqa: E731
    return {
        "model": MODEL,
        "clients": clients,
        "requests": len(results),
        "stopped": stopped,
        "errors": len(errors),
        "error_samples": errors[:3],
        "latency_p50_s": quantile(latencies, 0.5),
        "latency_p99_s": quantile(latencies, 0.99),
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p99_s": quantile(ttfts, 0.99),
        "mean_latency_s": round(statistics.fmean(latencies), 3) if latencies else None,
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "completion_tokens": sum(r["tokens"] for r in results),
        "wall_s": round(wall, 2),
        "tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("schema", "agent"), default="schema")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--turns", type=int, default=TURNS, help="agent workload: requests per conversation")
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false", help="the server without prefix caching"
    )
    args = parser.parse_args()
    if args.workload == "agent":
        jobs = agent_conversations(args.requests, args.turns)
    else:
        jobs = schema_requests(args.requests)
    app = build_app(MODEL, max_num_seqs=args.clients, enable_prefix_caching=args.prefix_caching)
    with ServerThread(app) as server:
        report = asyncio.run(_load(server.base_url, args.clients, jobs, args.deadline_s))
    planned = len(jobs) * args.turns if args.workload == "agent" else len(jobs)
    turns = {"turns": args.turns} if args.workload == "agent" else {}
    caching = {"prefix_caching": args.prefix_caching}
    print(json.dumps({"workload": args.workload, "planned": planned, **turns, **caching, **report}))


if __name__ == "__main__":
    main()
