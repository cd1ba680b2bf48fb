"""Grammar-forced drafting and closing masks: what they gain and what they cost, one JSON line per model.

    python benchmarks/grammar_drafts.py [--pairs demo-llama+eagle3 demo-deepseek+mtp] [--prompts 8]
                                        [--max-tokens 96] [--repeats 3]

Batch 1, k = 4, held-out demo prompts, each with its task's schema. For each target+draft pair,
interleaved over `--repeats` rounds (the fastest round of each case): tokens/s and accepted tokens per
step of plain decoding and of speculative decoding free, under the schemas with forced drafting, and
without it (`schema_unforced`); then the closing masks' cost: the same prompts with budgets six tokens
short of each free answer, closing on and off (how many answers validate, tokens/s) and the seconds
spent in the closer's search, derivation and restriction per step while it was on. Times are process
CPU seconds (all threads), which a machine shared with other work disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import jsonschema

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.grammars import closing
from tandem.llm import LLM, chat_prompt_ids

CLOSER_CALLS = ("search", "derive", "restrict")


def generate(llm: LLM, prompts: list[list[int]], schemas: list, budgets: list[int]) -> dict:
    """One request at a time; CPU seconds, tokens, steps, accepted drafts and the outputs."""
    engine, outputs = llm.engine, []
    start = time.process_time()
    for prompt, schema, budget in zip(prompts, schemas, budgets):
        request = engine.add_request(prompt, SamplingParams(max_tokens=budget, json_schema=schema))
        while engine.has_unfinished():
            engine.step()
        outputs.append(engine.pop_finished(request))
    seconds = time.process_time() - start
    steps = sum(o.stats.steps for o in outputs)
    generated = sum(len(o.token_ids) for o in outputs)
    return {
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "accepted_per_step": (sum(o.stats.accepted for o in outputs) + steps) / steps,
        "steps": steps,
        "outputs": outputs,
    }


def set_forced(llm: LLM, on: bool) -> None:
    llm.engine.forced_drafts = on and llm.engine.draft is not None
    llm.engine.step_masks.detect_forced = llm.engine.forced_drafts


def set_closing(llm: LLM, closer) -> None:
    llm.engine.masker.closer = closer
    llm.engine.step_masks.closing = closer is not None


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def timed_closer(spent: collections.Counter) -> None:
    """Count the CPU seconds of every Closer call in `spent`."""
    for name in CLOSER_CALLS:
        real = getattr(closing.Closer, name)

        def timed(self, *args, _real=real, _name=name, **kwargs):
            start = time.process_time()
            try:
                return _real(self, *args, **kwargs)
            finally:
                spent[_name] += time.process_time() - start

        setattr(closing.Closer, name, timed)


def bench_pair(model: str, draft: str, args: argparse.Namespace, spent: collections.Counter) -> dict:
    plain, speculative = LLM(model, None, max_num_seqs=1), LLM(model, draft, num_speculative_tokens=4, max_num_seqs=1)
    examples = generate_examples(args.prompts, seed=1, split="heldout")
    prompts = [chat_prompt_ids(plain.tokenizer, e.messages, e.tools) for e in examples]
    schemas = [TASK_FAMILIES[e.family].schema for e in examples]
    free, budgets = [None] * len(prompts), [args.max_tokens] * len(prompts)
    cases = {
        "plain_free": (plain, free, False),
        "plain_schema": (plain, schemas, False),
        "free": (speculative, free, True),
        "schema_forced": (speculative, schemas, True),
        "schema_unforced": (speculative, schemas, False),
    }
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, (llm, case_schemas, forced) in cases.items():
            set_forced(llm, forced)
            run = generate(llm, prompts, case_schemas, budgets)
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    set_forced(speculative, True)
    result = {
        name: {"tokens_per_s": round(run["tokens_per_s"], 2), "accepted_per_step": round(run["accepted_per_step"], 3)}
        for name, run in best.items()
    }
    pairs = (("free", "plain_free"), ("schema_forced", "plain_schema"), ("schema_unforced", "plain_schema"))
    result["exact"] = all(
        [o.token_ids for o in best[spec]["outputs"]] == [o.token_ids for o in best[base]["outputs"]]
        for spec, base in pairs
    )
    rate = {name: run["tokens_per_s"] for name, run in best.items()}
    result["schema_vs_free"] = {
        "forced": round(rate["schema_forced"] / rate["free"], 3),
        "unforced": round(rate["schema_unforced"] / rate["free"], 3),
    }
    answers = generate(speculative, prompts, schemas, [160] * len(prompts))["outputs"]
    short = [max(len(o.token_ids) - 6, 1) for o in answers]
    closer, closing_runs = speculative.engine.masker.closer, {}
    for _ in range(args.repeats):
        for on in (True, False):
            set_closing(speculative, closer if on else None)
            spent.clear()
            run = generate(speculative, prompts, schemas, short)
            run["closer_seconds"] = dict(spent)
            if on not in closing_runs or run["seconds"] < closing_runs[on]["seconds"]:
                closing_runs[on] = run
    set_closing(speculative, closer)
    for on, run in closing_runs.items():
        entry = {
            "tokens_per_s": round(run["tokens_per_s"], 2),
            "valid": sum(valid(o.text, s) for o, s in zip(run["outputs"], schemas)),
            "requests": len(prompts),
        }
        if on:
            spent_ms = {name: seconds / run["steps"] * 1e3 for name, seconds in run["closer_seconds"].items()}
            entry["closer_ms_per_step"] = {name: round(ms, 3) for name, ms in spent_ms.items()}
        result["closing_on" if on else "closing_off"] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["demo-llama+eagle3", "demo-deepseek+mtp"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spent: collections.Counter = collections.Counter()
    timed_closer(spent)
    for pair in args.pairs:
        model, draft = pair.split("+")
        print(json.dumps({"pair": pair, **bench_pair(model, draft, args, spent)}), flush=True)


if __name__ == "__main__":
    main()
