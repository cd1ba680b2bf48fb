"""What adaptive speculation chooses on this device, and what it gets: plain, adaptive and fixed-k decoding.

    python benchmarks/adaptive.py [--device cuda] [--dtype bfloat16] [--graph-mode compiled] [--k 4] [--batch 1]

For each demo target with its draft (demo-llama + EAGLE-3, demo-deepseek + MTP): the plain path, adaptive
speculation (``EngineConfig.adaptive``, the default) and fixed k over the held-out demo chats (greedy, rows
ending at EOS or ``--max-tokens``), ``--repeats`` interleaved rounds. Each case gives its fastest round's
``tokens_per_s`` and its ``tokens_per_step`` (decode steps: the prefill's first token left out), and its ratio to
plain. The adaptive case also gives what its policy saw and chose (``tandem.engine.adaptive``): ``chosen``, row-steps
by drafts; ``verify_ms``, the cost model's points (verified tokens -> ms of a step to its commit); ``draft_ms``, a
proposal's ms by its passes; ``step_ms_by_drafts``, the median wall time of its steps by the most drafts a row
verified in them, beside each case's mean ``step_ms``: whether a step without drafts costs what the model expects.
Speculation that never loses has adaptive/plain >= 1 on every device. One JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from graph_steps import PAIRS, sync

from tandem import LLM, SamplingParams
from tandem.demo.corpus import generate_examples
from tandem.llm import chat_prompt_ids
from tandem.models.loading import DTYPES

CASES = ("plain", "adaptive", "fixed")


def run_round(
    engine, prompts: list[list[int]], batch: int, max_tokens: int, step_ms: dict[int, list[float]] | None = None
) -> tuple[float, int, int]:
    """Seconds, decode steps and decode tokens for every prompt, ``batch`` at a time. With ``step_ms`` (an adaptive
    engine's), each decode step's wall time in ms goes to ``step_ms[j]``, j the most drafts a row verified in it
    (what the policy chose in the step before)."""
    seconds = steps = tokens = 0
    policy = None if step_ms is None else engine.policy
    for i in range(0, len(prompts), batch):
        ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts[i : i + batch]]
        sync(engine.device)
        start = time.perf_counter()
        first, verified = True, None
        while engine.has_unfinished():
            chosen = None if policy is None else dict(policy.chosen)
            began = time.perf_counter()
            emitted = sum(len(delta.token_ids) for delta in engine.step())
            if not first:
                steps, tokens = steps + 1, tokens + emitted
                if verified is not None:
                    step_ms.setdefault(verified, []).append((time.perf_counter() - began) * 1000)
            first = False
            if policy is not None:
                grown = [k for k, n in policy.chosen.items() if n > chosen.get(k, 0)]
                verified = max(grown) if grown else None
        sync(engine.device)
        seconds += time.perf_counter() - start
        for request_id in ids:
            engine.pop_finished(request_id)
    return seconds, steps, tokens


def policy_report(policy, step_ms: dict[int, list[float]]) -> dict:
    """What an engine's adaptive policy chose, the costs it chose by (ms), and the median wall time of its steps by
    the most drafts they verified (ms; `run_round`'s ``step_ms``)."""

    def points_ms(cost) -> dict[int, float]:
        return {size: round(seconds * 1000, 3) for size, seconds in zip(cost.tokens, cost.seconds)}

    return {
        "chosen": dict(sorted(policy.chosen.items())),
        "verify_ms": points_ms(policy.cost),
        "draft_ms": points_ms(policy.draft_cost),
        "step_ms_by_drafts": {k: round(statistics.median(ms), 3) for k, ms in sorted(step_ms.items())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(PAIRS), default=sorted(PAIRS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    parser.add_argument("--graph-mode", default="auto", choices=["auto", "eager", "compiled"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    report = {"benchmark": "adaptive", "device": args.device, "dtype": args.dtype, "graph_mode": args.graph_mode,
              "k": args.k, "batch": args.batch, "models": {}}  # fmt: skip
    examples = generate_examples(args.prompts, seed=0, split="heldout")
    for model in args.models:
        llms = {
            case: LLM(
                model,
                None if case == "plain" else PAIRS[model],
                num_speculative_tokens=args.k,
                device=args.device,
                dtype=None if args.dtype is None else DTYPES[args.dtype],
                max_num_seqs=args.batch,
                graph_mode=args.graph_mode,
                adaptive=case == "adaptive",
            )
            for case in CASES
        }
        prompts = [chat_prompt_ids(llms["plain"].tokenizer, ex.messages, ex.tools) for ex in examples]
        for llm in llms.values():  # warm-up, a whole round: every graph the rounds meet, caches, the policy's timings
            run_round(llm.engine, prompts, args.batch, args.max_tokens)
        rounds, step_ms = {case: [] for case in CASES}, {}
        for _ in range(args.repeats):
            for case, llm in llms.items():
                timed = step_ms if case == "adaptive" else None
                rounds[case].append(run_round(llm.engine, prompts, args.batch, args.max_tokens, timed))
        rows = {}
        for case, runs in rounds.items():
            seconds, steps, tokens = min(runs)  # the fastest round
            rows[case] = {
                "tokens_per_s": round(tokens / seconds, 1),
                "tokens_per_step": round(tokens / steps, 3),
                "step_ms": round(seconds / steps * 1000, 3),
            }
        for case in CASES[1:]:
            rows[case]["over_plain"] = round(rows[case]["tokens_per_s"] / rows["plain"]["tokens_per_s"], 3)
        rows["adaptive"] |= policy_report(llms["adaptive"].engine.policy, step_ms)
        report["models"][f"{model}+{PAIRS[model]}"] = rows
        print(json.dumps({model: rows}), flush=True)
        for llm in llms.values():
            llm.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
