"""Bounded load run of `tandem serve` on loopback: concurrent streaming clients, every answer checked.

Starts the server in-process on 127.0.0.1 (a free port), then CLIENTS asyncio clients share
REQUESTS streaming chat requests drawn from the demo corpus's held-out prompts, each with its
task family's JSON schema as `response_format`, its free strings capped at MAX_STRING characters
(the tiny demo models, decoding greedily, sometimes repeat inside a string until max_tokens; a
cap is what a production schema would carry, and it makes every answer end). Stops after the last request or DEADLINE_S,
whichever comes first, and prints one JSON object: requests, errors (HTTP failures, unfinished
or schema-invalid answers), p50/p99 latency and time to first token, and total tokens/s.

    python benchmarks/serve_load.py [--clients 32] [--requests 96] [--deadline-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import jsonschema
from openai import AsyncOpenAI

from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.serve.server import ServerThread, build_app

MODEL = "demo-llama"
MAX_TOKENS = 512
MAX_STRING = 64


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


async def _one(client: AsyncOpenAI, example, results: list[dict]) -> None:
    """One streaming request; appends {latency_s, ttft_s, tokens, error}."""
    schema = bounded(TASK_FAMILIES[example.family].schema)
    start, first, content, tokens, error = time.perf_counter(), None, "", 0, None
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=example.messages,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            response_format={"type": "json_schema", "json_schema": {"name": example.family, "schema": schema}},
        )
        finish = None
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                first = first or time.perf_counter()
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
        if finish != "stop":
            error = f"finish_reason {finish!r} after {tokens} tokens ({len(content)} answer characters)"
        else:
            jsonschema.validate(json.loads(content), schema)
    except Exception as e:  # every failure counts as an error of this request
        error = f"{type(e).__name__}: {e}"
    error = error and f"{example.family}: {error}"
    end = time.perf_counter()
    results.append({"latency_s": end - start, "ttft_s": (first or end) - start, "tokens": tokens, "error": error})


async def _load(base_url: str, clients: int, requests: int, deadline_s: float) -> dict:
    examples = generate_examples(requests, seed=1, split="heldout")
    queue: asyncio.Queue = asyncio.Queue()
    for example in examples:
        queue.put_nowait(example)
    results: list[dict] = []
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=deadline_s)

    async def worker() -> None:
        while not queue.empty():
            await _one(client, queue.get_nowait(), results)

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
        "planned": requests,
        "stopped": stopped,
        "errors": len(errors),
        "error_samples": errors[:3],
        "latency_p50_s": quantile(latencies, 0.5),
        "latency_p99_s": quantile(latencies, 0.99),
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p99_s": quantile(ttfts, 0.99),
        "mean_latency_s": round(statistics.fmean(latencies), 3) if latencies else None,
        "completion_tokens": sum(r["tokens"] for r in results),
        "wall_s": round(wall, 2),
        "tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--deadline-s", type=float, default=60.0)
    args = parser.parse_args()
    with ServerThread(build_app(MODEL, max_num_seqs=args.clients)) as server:
        report = asyncio.run(_load(server.base_url, args.clients, args.requests, args.deadline_s))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
