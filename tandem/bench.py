"""`tandem bench`: speculative vs plain decoding on the demo models, in one run, as ratios.

For each shipped demo model: tokens/s of the plain path and of every available draft (k = 2, 4),
mean accepted length, with and without the task's JSON schema, relaxed acceptance on and off,
batch 1 and 8; and `transformers`' own `generate` on the same weights (plain, and with prompt
lookup, its n-gram speculation). Prompts are held-out demo-corpus chats. Greedy throughout, so
every speculative run must reproduce the plain run's tokens (checked, reported as `exact`).
Each measurement is the fastest of `--repeats` runs (timeit's rule: slower runs measure the
machine's other load, not the code), and the runs of all measurements are interleaved in rounds. One JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch

from tandem.decoding.params import RelaxedAcceptance, SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["demo-llama", "demo-deepseek"])
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per measurement")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: the demo models are too small to gain from more)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest counts")
    parser.add_argument("--json", action="store_true", help="only the JSON line")


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    report = {"benchmark": "tandem bench", "threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
              "prompts": args.prompts, "repeats": args.repeats, "models": {}}
    for model in args.models:
        report["models"][model] = _bench_model(model, args)
    print(json.dumps(report))
    return 0


def _log(args: argparse.Namespace, message: str) -> None:
    if not args.json:
        print(message, flush=True)


def _bench_model(model: str, args: argparse.Namespace) -> dict:
    from tandem.demo.corpus import TASK_FAMILIES, generate_examples
    from tandem.llm import LLM, available_drafts, chat_prompt_ids, resolve_model
    from tandem.models.loading import load_tokenizer

    path = resolve_model(model)
    examples = generate_examples(args.prompts, seed=1, split="heldout")
    tokenizer = load_tokenizer(path)
    prompts = [chat_prompt_ids(tokenizer, ex.messages, ex.tools) for ex in examples]  # the same ids for every run
    cases: dict[tuple, Callable[[int], dict]] = {}  # (draft, k, relaxed, schema, batch) -> run(max_tokens)
    for draft in [None, *available_drafts(path)]:
        for k in args.k if draft else [0]:
            for relaxed in ([None, RelaxedAcceptance()] if draft else [None]):
                llm = LLM(model, draft, num_speculative_tokens=max(k, 1), relaxed=relaxed, max_num_seqs=max(args.batch))
                for constrained in (False, True):
                    schemas = [TASK_FAMILIES[ex.family].schema if constrained else None for ex in examples]
                    for batch in args.batch:
                        cases[draft or "none", k, relaxed is not None, constrained, batch] = functools.partial(
                            _measure, llm, prompts, schemas, batch)
    for mode, extra in _transformers_modes(args):
        cases["transformers", mode] = functools.partial(_measure_transformers, path, tokenizer, prompts, extra)
    best = _fastest_of_rounds(cases, args)

    plain_tokens = {key[3:]: best[key]["tokens"] for key in best if key[0] == "none"}
    results: list[dict] = []
    for key, row in best.items():
        if key[0] == "transformers":
            continue
        draft, k, relaxed, constrained, batch = key
        tokens = row.pop("tokens")
        row["exact"] = relaxed or tokens == plain_tokens[constrained, batch]
        row.update(draft=draft, k=k, relaxed=relaxed, schema=constrained, batch=batch)
        results.append(row)
        _log(args, f"{model:14s} draft={draft:7s} k={k} relaxed={relaxed!s:5s} schema={constrained!s:5s} "
                   f"batch={batch}  {row['tokens_per_s']:8.1f} tok/s  accepted length {row['mean_accepted_length']:.2f}")
    peers = [{"mode": key[1], **row} for key, row in best.items() if key[0] == "transformers"]
    for row in peers:
        _log(args, f"{model:14s} transformers {row['mode']:13s} batch=1  {row['tokens_per_s']:8.1f} tok/s")
    return {"runs": results, "transformers": peers, "ratios": _ratios(results, peers, max(args.k), min(args.batch))}


def _fastest_of_rounds(cases: dict[tuple, Callable[[int], dict]], args: argparse.Namespace) -> dict[tuple, dict]:
    """Warm every case up, then run all of them once per round, `repeats` rounds; each case's fastest run.

    Rounds interleave the cases, so a stretch of machine load slows all of them alike instead of
    one case's every run.
    """
    for run in cases.values():
        run(4)  # warm-up; compiles (and caches) the schemas
    best: dict[tuple, dict] = {}
    for _ in range(args.repeats):
        for key, run in cases.items():
            row = run(args.max_tokens)
            if key not in best or row["seconds"] < best[key]["seconds"]:
                best[key] = row
    return best


def _measure(llm, prompts: list[list[int]], schemas: list, batch: int, max_tokens: int) -> dict:
    """Generate every prompt in groups of `batch` (one schema per prompt); time and count."""
    engine = llm.engine
    outputs = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = range(first, min(first + batch, len(prompts)))
        ids = [engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens, json_schema=schemas[i]))
               for i in group]
        while engine.has_unfinished():
            engine.step()
        outputs.extend(engine.pop_finished(i) for i in ids)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    steps = sum(o.stats.steps for o in outputs)
    accepted = sum(o.stats.accepted for o in outputs)
    return {"tokens_per_s": round(generated / seconds, 2), "generated": generated, "seconds": round(seconds, 3),
            "mean_accepted_length": round((accepted + steps) / max(steps, 1), 3),
            "tokens": [o.token_ids for o in outputs]}


def _transformers_modes(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """transformers' generate, batch 1, greedy: plain, and prompt lookup (its n-gram speculation)."""
    return [("plain", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": max(args.k)})]


@functools.cache
def _transformers_model(path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # its load report lists the MTP layer it does not use
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _measure_transformers(path, tokenizer, prompts: list[list[int]], extra: dict, max_tokens: int) -> dict:
    """transformers' generate on the same weights and prompts; time and count."""
    model = _transformers_model(path)
    generated, start = 0, time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **extra)
        generated += out.shape[1] - ids.shape[1]
    seconds = time.perf_counter() - start
    return {"tokens_per_s": round(generated / seconds, 2), "generated": generated, "seconds": round(seconds, 3)}


def _ratios(runs: list[dict], peers: list[dict], k: int, batch: int) -> dict:
    """The headline ratios, greedy, for the largest k and the smallest batch measured (transformers
    runs batch 1)."""
    def rate(**where):
        rows = [r for r in runs if all(r[key] == value for key, value in where.items())]
        return max((r["tokens_per_s"] for r in rows), default=None)

    plain = rate(draft="none", schema=False, batch=batch)
    ratios = {"tandem_plain_vs_transformers_plain": round(plain / peers[0]["tokens_per_s"], 3)}
    for draft in sorted({r["draft"] for r in runs} - {"none"}):
        spec = rate(draft=draft, k=k, relaxed=False, schema=False, batch=batch)
        spec_schema = rate(draft=draft, k=k, relaxed=False, schema=True, batch=batch)
        if spec is not None:
            ratios[f"{draft}_k{k}_vs_plain"] = round(spec / plain, 3)
        if spec and spec_schema:
            ratios[f"{draft}_k{k}_schema_vs_unconstrained"] = round(spec_schema / spec, 3)
    return ratios
