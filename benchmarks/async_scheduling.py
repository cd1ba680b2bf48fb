"""An engine setting off and on, the two interleaved in one process: async scheduling against synchronous steps
(plain decoding), or lookahead proposals against proposals after the commit (speculative decoding).

    python benchmarks/async_scheduling.py [--device cuda] [--dtype bfloat16] [--models demo-llama demo-deepseek]
        [--batch 1 8] [--graph-mode compiled] [--rounds 5] [--steps 64] [--schema [--max-tokens 96]]
        [--setting async_scheduling|lookahead]

For each demo target and batch size, two engines (``--setting`` off and on: ``async_scheduling`` on the target
alone, ``lookahead`` on the target with its draft, demo-llama + EAGLE-3 and demo-deepseek + MTP) decode the same
rows, which run through EOS (``ignore_eos``), in alternating rounds of ``--steps`` steps after a warm-up of 16 (with
``--schema``: each row under its example's JSON schema, every round from prefill to the rows' ends, ``--max-tokens``
at most), after an untimed round each: per engine ``step_ms`` (the median round and the range), ``tokens_per_s`` of
the median round and, with async scheduling, ``read_wait_ms``, the host's wait per step for the in-flight step's
tokens (near the step's time: the device bounds the step; near 0: the host does). ``async_over_sync`` (or
``lookahead_over_commit``) is the ratio of the medians' tokens/s, and ``exact`` whether both engines emitted the
same tokens in every round (greedy rows). One JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from tandem import LLM, SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.engine import in_flight
from tandem.llm import chat_prompt_ids
from tandem.models.loading import DTYPES


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ReadClock:
    """Seconds spent in `InFlight.read` (the wait for an in-flight step's tokens), while installed."""

    def __init__(self) -> None:
        self.seconds, self._read = 0.0, in_flight.InFlight.read

    def __enter__(self) -> ReadClock:
        clock, read = self, self._read

        def timed(flight):
            start = time.perf_counter()
            try:
                return read(flight)
            finally:
                clock.seconds += time.perf_counter() - start

        in_flight.InFlight.read = timed
        return self

    def __exit__(self, *_) -> None:
        in_flight.InFlight.read = self._read


def round_of(engine, prompts: list[list[int]], steps: int) -> dict:
    """One round: the rows' prefill and 16 warm-up steps, then ``steps`` timed ones; the engine empty after."""
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=10**6, ignore_eos=True)) for prompt in prompts]
    tokens = []  # (request id, new tokens) of every step's deltas
    for _ in range(16):
        tokens += [(delta.request_id, delta.token_ids) for delta in engine.step()]
    sync(engine.device)
    with ReadClock() as clock:
        start, timed = time.perf_counter(), len(tokens)
        for _ in range(steps):
            tokens += [(delta.request_id, delta.token_ids) for delta in engine.step()]
        sync(engine.device)
        seconds = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    emitted = {request_id: [] for request_id in ids}
    for request_id, new in tokens:
        emitted[request_id] += new
    return {
        "step_ms": seconds * 1000 / steps,
        "tokens": sum(len(new) for _, new in tokens[timed:]),
        "seconds": seconds,
        "read_wait_ms": clock.seconds * 1000 / steps,
        "emitted": [emitted[i] for i in ids],
    }


def schema_round(engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """One round of requests under JSON schemas, prefill to their last token (they finish when their answers close,
    or at max_tokens): the round's time per step, and each request's tokens."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    sync(engine.device)
    with ReadClock() as clock:
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        sync(engine.device)
        seconds = time.perf_counter() - start
    emitted = [engine.pop_finished(request_id).token_ids for request_id in ids]
    return {
        "step_ms": seconds * 1000 / steps,
        "tokens": sum(map(len, emitted)),
        "seconds": seconds,
        "read_wait_ms": clock.seconds * 1000 / steps,
        "emitted": emitted,
    }


PAIRS = {"demo-llama": "eagle3", "demo-deepseek": "mtp"}  # --setting lookahead: each target's draft
NAMES = {  # per setting: its engines' names, off and on, and their ratio's
    "async_scheduling": ("sync", "async", "async_over_sync"),
    "lookahead": ("after_commit", "lookahead", "lookahead_over_commit"),
}


def compare(engines: dict[bool, LLM], play: Callable[[object], dict], rounds: int, setting: str) -> dict:
    """Alternating rounds of the engine with ``setting`` off and on (each round's first alternates too), after an
    untimed one each (grammars compile, graphs build): ``play(engine)`` runs a round."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for overlap in (False, True):
        play(engines[overlap].engine)
    for r in range(rounds):
        for overlap in (False, True) if r % 2 == 0 else (True, False):
            runs[overlap].append(play(engines[overlap].engine))
    row, (off, on, ratio) = {}, NAMES[setting]
    for overlap, name in ((False, off), (True, on)):
        median = sorted(runs[overlap], key=lambda run: run["step_ms"])[len(runs[overlap]) // 2]
        row[name] = {
            "step_ms": round(median["step_ms"], 3),
            "step_ms_range": [
                round(min(run["step_ms"] for run in runs[overlap]), 3),
                round(max(run["step_ms"] for run in runs[overlap]), 3),
            ],  # fmt: skip
            "tokens_per_s": round(median["tokens"] / median["seconds"], 1),
        }
        if overlap and setting == "async_scheduling":
            row[name]["read_wait_ms"] = round(statistics.median(run["read_wait_ms"] for run in runs[overlap]), 3)
    row[ratio] = round(row[on]["tokens_per_s"] / row[off]["tokens_per_s"], 3)
    # The async engine's rounds reach the host a step later: compare what both emitted in common.
    row["exact"] = all(
        a[: len(b)] == b[: len(a)]
        for sync_run, async_run in zip(runs[False], runs[True])
        for a, b in zip(sync_run["emitted"], async_run["emitted"])
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--models", nargs="+", default=["demo-llama", "demo-deepseek"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--graph-mode", choices=["auto", "eager", "compiled"], default="compiled")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64, help="timed steps per round")
    parser.add_argument(
        "--schema", action="store_true", help="each request under its example's JSON schema, run to its end"
    )
    parser.add_argument("--max-tokens", type=int, default=96, help="with --schema: each request's max_tokens")
    parser.add_argument("--setting", choices=sorted(NAMES), default="async_scheduling", help="what the engines toggle")
    args = parser.parse_args(argv)
    report = {"benchmark": args.setting, "device": args.device, "dtype": args.dtype, "cases": []}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(args.device)
    examples = generate_examples(max(args.batch), seed=1, split="heldout")
    for model in args.models:
        settings = dict(device=args.device, dtype=DTYPES[args.dtype], max_num_seqs=max(args.batch))
        draft = PAIRS[model] if args.setting == "lookahead" else None
        engines = {
            o: LLM(model, draft, graph_mode=args.graph_mode, **{args.setting: o}, **settings) for o in (False, True)
        }
        prompts = [chat_prompt_ids(engines[False].tokenizer, e.messages, e.tools) for e in examples]
        params = [
            SamplingParams(max_tokens=args.max_tokens, json_schema=TASK_FAMILIES[e.family].schema) for e in examples
        ]
        for batch in args.batch:
            if args.schema:
                play = functools.partial(schema_round, prompts=prompts[:batch], params=params[:batch])
            else:
                play = functools.partial(round_of, prompts=prompts[:batch], steps=args.steps)
            row = {"model": model, "batch": batch, "schema": args.schema}
            row |= compare(engines, play, args.rounds, args.setting)
            report["cases"].append(row)
            print(json.dumps(row), flush=True)
        for llm in engines.values():
            llm.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
