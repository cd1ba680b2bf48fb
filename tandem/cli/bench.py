"""`tandem bench`: speculative vs plain decoding on the demo models, in one run, as ratios.

For each shipped demo model: tokens/s of the plain path and of every available draft (k = 2, 4),
mean accepted length, with and without the task's JSON schema, relaxed acceptance on and off,
batch 1 and 8; and `transformers`' own `generate` on the same weights (plain, and with prompt
lookup, its n-gram speculation). tandem's runs also give their decode tokens/s: the tokens after
each request's first one over the time after it (1 / TPOT at batch 1), which leaves out the
prefill, a sizeable share of the short demo chats' time. Prompts are held-out demo-corpus chats.
Greedy throughout, so every speculative run without relaxed acceptance must reproduce the plain
run's tokens (checked in every round, reported as `exact`). Relaxed runs may differ by design:
they report `token_match` instead, the share of their output tokens equal to the plain run's
(per prompt, aligned positions, over every round; `exact` is null). Schema runs also report
`schema_valid`, the share of their answers that parse as JSON and validate against the schema
(plain runs too: truncated answers, at `--max-tokens`, do not). `--models`, `--drafts`, `--k`, `--batch`, `--prompts`,
`--max-tokens` and `--repeats` narrow a run (tests/cli/test_bench.py takes one of each).

`--graph-mode eager compiled` measures every case in each graph mode (`LLM(graph_mode=...)`), interleaved
like the rest; each row carries its `graph_mode`, exactness is checked against the plain run of the same
mode, the headline `ratios` are those of the first mode listed, and `compiled_vs_eager` gives, per draft,
k, batch and schema, the median within-round ratio of compiled to eager tokens/s. `graph_runners` lists what
each engine with a graph runner (`engine.runner`) reports: start-up compile time, graph memory, eager
fallbacks and replays.

The machine's speed drifts over seconds, so the cases are interleaved finely: each of
`--repeats` rounds runs every case on the first prompt group, then every case on the second, and
so on. A case's tokens/s is its fastest round (timeit's rule: slower rounds measure
the machine's other load, not the code); a ratio is the median over rounds of the ratio within a
round, where both sides saw the same stretch of machine, and `ratio_range` gives its spread. `ratios` names
each draft's for every batch (`eagle3_k4_batch8_vs_plain`): speculative over plain, constrained over
unconstrained, and speculative over plain under the schema. One
JSON object on the last line of stdout; on the CPU its `cpu_kernels` say which C kernels ran (the linear's
build, `TANDEM_CPU_LINEAR`). Prefix caching is off: the rounds repeat the same prompts, whose
prefill a cache would skip (`benchmarks/serve_load.py --workload agent` measures the cache).

Progress (`--progress`): a bar on stderr with the model, the case and the round running, the time
spent and an estimate of the time left (from the token budget done so far), for the warm-up and then
for the rounds. `auto` shows it only when stderr is a terminal: a bar redraws itself with carriage
returns, which in a log file or a CI capture become thousands of lines; `on` forces it. Stdout keeps
only the per-case lines (none with `--json`) and the JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import jsonschema
import torch
from tqdm import tqdm

from tandem.cli.options import add_graph_mode_argument, add_parallel_arguments, parallel_settings, positive_int
from tandem.decoding.params import RelaxedAcceptance, SamplingParams
from tandem.models.loading import DTYPES

DRAFT_KINDS = ["eagle3", "eagle", "mtp", "ngram", "suffix"]  # tandem.llm.available_drafts' kinds
Run = Callable[[list[int], int], dict]  # (prompt indices, max_tokens) -> {"seconds", "generated", ...}
WARMUP_TOKENS = 4  # max_tokens of each case's warm-up pass
GRAPH_STATS = ("compile_s", "graph_bytes", "fallbacks", "replays")  # read from `llm.engine.runner` if there


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["demo-llama", "demo-deepseek"])
    parser.add_argument("--revision", default=None, help="the hub revision (branch, tag or commit) of org/name models")
    parser.add_argument(
        "--drafts",
        nargs="+",
        choices=DRAFT_KINDS,
        default=None,
        help="draft kinds to measure, among each model's available ones (default: all it has); "
        "the plain path is always measured",
    )
    parser.add_argument("--prompts", type=positive_int, default=8, help="held-out prompts per measurement")
    parser.add_argument("--max-tokens", type=positive_int, default=96)
    parser.add_argument("--k", type=positive_int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's own); tandem's steps of a few tokens take "
        "one either way (EngineConfig.small_step_threads)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: cuda when there is one)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights' dtype (default: float32 on the CPU, the checkpoint's elsewhere)",
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved rounds of every measurement")
    add_graph_mode_argument(parser, several=True)
    add_parallel_arguments(parser)
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    parser.add_argument(
        "--progress",
        choices=["auto", "on", "off"],
        default="auto",
        help="a progress bar on stderr (auto: when stderr is a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from tandem.llm import resolve_device

    args.graph_mode = list(dict.fromkeys(args.graph_mode))  # each mode once, in the order given
    report = {
        "benchmark": "tandem bench",
        "device": resolve_device(args.device),
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "graph_modes": args.graph_mode,
        "models": {},
    }
    if torch.device(report["device"]).type == "cpu":  # which C kernels the figures ran on (README, "fast paths")
        from tandem.kernels import cpu_attention, cpu_linear, cpu_norm

        report["cpu_kernels"] = {
            "linear": cpu_linear.ISA,
            "norm": cpu_norm.available(),
            "attention": cpu_attention.available(),
        }
    show = {"on": True, "off": False, "auto": sys.stderr.isatty()}[args.progress]
    for model in args.models:
        with tqdm(desc=model, file=sys.stderr, disable=not show, unit="tok", smoothing=0, dynamic_ncols=True) as bar:
            report["models"][model] = _bench_model(model, args, bar)
    print(json.dumps(report))
    return 0


def _log(args: argparse.Namespace, message: str) -> None:
    """A line on stdout (none with --json), written around the progress bar."""
    if not args.json:
        tqdm.write(message, file=sys.stdout)


def _label(key: tuple) -> str:
    """A case's name on the progress bar."""
    if key[0] == "transformers":
        return f"transformers {key[1]}"
    draft, k, relaxed, constrained, batch, mode = key
    return f"{draft} k={k}{' relaxed' if relaxed else ''}{' schema' if constrained else ''} batch={batch} {mode}"


def _bench_model(model: str, args: argparse.Namespace, bar: tqdm) -> dict:
    from tandem.demo.corpus import TASK_FAMILIES, generate_examples
    from tandem.llm import LLM, available_drafts, chat_prompt_ids, resolve_model
    from tandem.models.loading import load_tokenizer

    path = resolve_model(model, args.revision)
    examples = generate_examples(args.prompts, seed=1, split="heldout")
    tokenizer = load_tokenizer(path)
    prompts = [chat_prompt_ids(tokenizer, ex.messages, ex.tools) for ex in examples]  # the same ids for every run
    groups = {
        batch: [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
        for batch in args.batch
    }
    cases: dict[tuple, tuple[Run, list[list[int]]]] = {}  # (draft, k, relaxed, schema, batch, mode) -> (run, groups)
    engines: dict[tuple, object] = {}  # (draft, k, relaxed, mode) -> its LLM
    drafts = [d for d in available_drafts(path) if args.drafts is None or d in args.drafts]
    for draft in [None, *drafts]:
        for k in args.k if draft else [0]:
            for relaxed in [None, RelaxedAcceptance()] if draft else [None]:
                for mode in args.graph_mode:
                    bar.set_description(f"{model} loading {draft or 'plain'} k={k} {mode}")
                    llm = LLM(
                        model,
                        draft,
                        num_speculative_tokens=max(k, 1),
                        relaxed=relaxed,
                        max_num_seqs=max(args.batch),
                        device=args.device,
                        dtype=DTYPES.get(args.dtype),
                        graph_mode=mode,
                        revision=args.revision,
                        enable_prefix_caching=False,  # rounds repeat the prompts: measure decoding, not the cache
                        **parallel_settings(args),
                    )
                    engines[draft or "none", k, relaxed is not None, mode] = llm
                    for constrained in (False, True):
                        schemas = [TASK_FAMILIES[ex.family].schema if constrained else None for ex in examples]
                        for batch in args.batch:
                            run = functools.partial(measure, llm, prompts, schemas, _validators(schemas))
                            key = draft or "none", k, relaxed is not None, constrained, batch, mode
                            cases[key] = run, groups[batch]
    for mode, extra in _transformers_modes(args):
        like = torch.empty(0, dtype=llm.target.dtype, device=llm.engine.device)
        run = functools.partial(_measure_transformers, path, like, tokenizer, prompts, extra)
        cases["transformers", mode] = run, [[i] for i in range(len(prompts))]
    rounds = _interleaved_rounds(cases, args, model, bar)

    plain_tokens = {key[3:]: rounds[key][0]["tokens"] for key in rounds if key[0] == "none"}
    results: list[dict] = []
    for key, runs in rounds.items():
        if key[0] == "transformers":
            continue
        draft, k, relaxed, constrained, batch, mode = key
        row = _fastest(runs)
        plain = plain_tokens[constrained, batch, mode]
        if relaxed:  # may differ by design: how much it did
            row["exact"] = None
            row["token_match"] = round(_token_match([run["tokens"] for run in runs], plain), 4)
        else:
            row["exact"] = all(run["tokens"] == plain for run in runs)
        if constrained:
            row["schema_valid"] = round(sum(r["valid"] for r in runs) / max(sum(r["requests"] for r in runs), 1), 4)
        row.update(draft=draft, k=k, relaxed=relaxed, schema=constrained, batch=batch, graph_mode=mode)
        results.append(row)
        _log(
            args,
            f"{model:14s} draft={draft:7s} k={k} relaxed={relaxed!s:5s} schema={constrained!s:5s} "
            f"batch={batch} {mode:8s}  {row['tokens_per_s']:8.1f} tok/s  "
            f"accepted length {row['mean_accepted_length']:.2f}",
        )
    peers = [{"mode": key[1], **_fastest(runs)} for key, runs in rounds.items() if key[0] == "transformers"]
    for row in peers:
        _log(args, f"{model:14s} transformers {row['mode']:13s} batch=1  {row['tokens_per_s']:8.1f} tok/s")
    ratios, ratio_range = _ratios(rounds, max(args.k), sorted(set(args.batch)), args.graph_mode[0])
    result = {"runs": results, "transformers": peers, "ratios": ratios, "ratio_range": ratio_range}
    if {"compiled", "eager"} <= set(args.graph_mode):
        result["compiled_vs_eager"], result["compiled_vs_eager_range"] = _compiled_vs_eager(rounds)
        for name, ratio in result["compiled_vs_eager"].items():
            _log(args, f"{model:14s} compiled/eager {name:24s} {ratio:6.3f}")
    result["graph_runners"] = _graph_runners(engines)
    for entry in result["graph_runners"]:
        _log(args, f"{model:14s} graphs " + " ".join(f"{name}={value}" for name, value in entry.items()))
    return result


def _graph_runners(engines: dict[tuple, object]) -> list[dict]:
    """What each engine with a graph runner reports of it: the mode it resolved to and `GRAPH_STATS`
    (start-up compile/capture seconds, graph memory, eager fallbacks and replays so far), those it has
    (an eager engine has no runner and reports nothing)."""
    entries = []
    for (draft, k, relaxed, mode), llm in engines.items():
        runner = getattr(llm.engine, "runner", None)
        stats = {name: _rounded(getattr(runner, name)) for name in GRAPH_STATS if hasattr(runner, name)}
        if stats:
            resolved = getattr(llm.engine, "graph_mode", mode)
            entries.append(
                {"draft": draft, "k": k, "relaxed": relaxed, "graph_mode": mode, "resolved": resolved, **stats}
            )
    return entries


def _rounded(value):
    return round(value, 3) if isinstance(value, float) else value


def _interleaved_rounds(
    cases: dict[tuple, tuple[Run, list[list[int]]]], args: argparse.Namespace, model: str, bar: tqdm
) -> dict[tuple, list[dict]]:
    """Warm every case up, then `repeats` rounds; each case's totals per round.

    Within a round the cases take turns prompt group by prompt group, so a stretch of machine load
    slows every case alike instead of one case's whole run. `bar` counts the token budget
    (max_tokens per prompt) of the warm-up, then restarts for the rounds: the warm-up's schema and
    graph compilation would otherwise skew the rounds' estimate of the time left.
    """
    prompts = sum(len(group) for _, groups in cases.values() for group in groups)
    bar.reset(total=prompts * WARMUP_TOKENS)
    for key, (run, groups) in cases.items():
        bar.set_description(f"{model} {_label(key)} warm-up")
        for group in groups:
            run(group, WARMUP_TOKENS)  # compiles (and caches) the schemas, and the graphs in compiled mode
            bar.update(len(group) * WARMUP_TOKENS)
    rounds: dict[tuple, list[dict]] = {key: [] for key in cases}
    bar.reset(total=prompts * args.repeats * args.max_tokens)
    for r in range(args.repeats):
        totals: dict[tuple, dict] = {key: {} for key in cases}
        for g in range(max(len(groups) for _, groups in cases.values())):
            for key, (run, groups) in cases.items():
                if g < len(groups):
                    bar.set_description(f"{model} {_label(key)} round {r + 1}/{args.repeats}")
                    for name, value in run(groups[g], args.max_tokens).items():  # sums (token lists: joined)
                        totals[key][name] = totals[key][name] + value if name in totals[key] else value
                    bar.update(len(groups[g]) * args.max_tokens)
        for key, total in totals.items():
            rounds[key].append(total)
    return rounds


def _fastest(runs: list[dict]) -> dict:
    """The fastest round's figures (tokens/s; for tandem's own runs also the decode tokens/s and
    the mean accepted length)."""
    run = min(runs, key=lambda r: r["seconds"])
    row = {"tokens_per_s": round(_rate(run), 2), "generated": run["generated"], "seconds": round(run["seconds"], 3)}
    if "steps" in run:
        row["decode_tokens_per_s"] = round(_decode_rate(run), 2)
        row["first_token_seconds"] = round(run["first_token_seconds"], 3)
        row["mean_accepted_length"] = round((run["accepted"] + run["steps"]) / max(run["steps"], 1), 3)
    return row


def _rate(run: dict) -> float:
    return run["generated"] / run["seconds"]


def _decode_rate(run: dict) -> float:
    """Tokens/s after each request's first token: the rate a streaming client sees (1 / TPOT at batch 1)."""
    return (run["generated"] - run["requests"]) / (run["seconds"] - run["first_token_seconds"])


def _token_match(outputs: list[list[list[int]]], plain: list[list[int]]) -> float:
    """The share of tokens equal to the plain run's at the same position of the same prompt, over
    rounds ``outputs`` (each a list of token lists, one per prompt, as ``plain``); a position only
    one of the two reached counts as different."""
    equal = total = 0
    for tokens in outputs:
        for ours, theirs in zip(tokens, plain, strict=True):
            equal += sum(a == b for a, b in zip(ours, theirs))
            total += max(len(ours), len(theirs))
    return equal / total if total else 1.0


def _validators(schemas: list) -> list:
    """One JSON-schema validator per prompt (None without a schema)."""
    return [
        None
        if schema is None
        else jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
        for schema in schemas
    ]


def _valid(validator, text: str) -> bool:
    try:
        return validator.is_valid(json.loads(text))
    except ValueError:
        return False


def measure(llm, prompts: list[list[int]], schemas: list, validators: list, group: list[int], max_tokens: int) -> dict:
    """Generate the prompts `group` as one batch (one schema per prompt); time and count.

    ``first_token_seconds`` is when every request had its first token (its prefill done), which
    splits ``seconds`` into prefill and decode; ``valid`` counts the answers that validate against
    their schema (the prompts with one).
    """
    engine = llm.engine
    start = time.perf_counter()
    ids = [engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens, json_schema=schemas[i])) for i in group]
    waiting_first_token, first_token_seconds = set(ids), None
    while engine.has_unfinished():
        deltas = engine.step()
        if waiting_first_token:
            waiting_first_token -= {d.request_id for d in deltas if d.token_ids or d.finish_reason}
            if not waiting_first_token:
                first_token_seconds = time.perf_counter() - start
    outputs = [engine.pop_finished(i) for i in ids]
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "first_token_seconds": first_token_seconds,
        "requests": len(ids),
        "generated": sum(len(o.token_ids) for o in outputs),
        "steps": sum(o.stats.steps for o in outputs),
        "accepted": sum(o.stats.accepted for o in outputs),
        "tokens": [o.token_ids for o in outputs],
        "valid": sum(_valid(validators[i], o.text) for i, o in zip(group, outputs) if validators[i] is not None),
    }


def _transformers_modes(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """transformers' generate, batch 1, greedy: plain, and prompt lookup (its n-gram speculation)."""
    return [("plain", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": max(args.k)})]


@functools.cache
def _transformers_model(path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # its load report lists the MTP layer it does not use
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def _measure_transformers(
    path, like: torch.Tensor, tokenizer, prompts: list[list[int]], extra: dict, group: list[int], max_tokens: int
) -> dict:
    """transformers' generate on the same weights, on the device and in the dtype of tensor `like`
    (tandem's target's), one prompt of `group` at a time; time and count."""
    model = _transformers_model(path, like.device, like.dtype)
    generated, start = 0, time.perf_counter()
    for i in group:
        ids = torch.tensor([prompts[i]], device=like.device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
                **extra,
            )
        generated += len(out[0].tolist()) - ids.shape[1]  # tolist: the device has finished
    return {"seconds": time.perf_counter() - start, "generated": generated}


def _ratios(rounds: dict[tuple, list[dict]], k: int, batches: list[int], mode: str) -> tuple[dict, dict]:
    """The headline ratios, greedy, for the largest k, each batch measured and graph mode `mode`, named
    `<draft>_k<k>_batch<batch>_<ratio>`: speculative over plain tokens/s (`vs_plain`, and `decode_vs_plain` after
    each request's first token), constrained over unconstrained (`schema_vs_unconstrained`) and speculative over
    plain, both under the schema (`schema_vs_plain`); and tandem's plain over transformers' at the smallest batch
    (transformers runs batch 1). Each is the median over rounds of the within-round ratio; and each one's
    [min, max] over rounds."""

    def ratio(numerator: tuple, denominator: tuple, rate: Callable[[dict], float] = _rate) -> list[float]:
        return sorted(rate(a) / rate(b) for a, b in zip(rounds[numerator], rounds[denominator]))

    per_round = {
        "tandem_plain_vs_transformers_plain": ratio(
            ("none", 0, False, False, min(batches), mode), ("transformers", "plain")
        )
    }
    for draft in sorted({key[0] for key in rounds} - {"none", "transformers"}):
        for batch in batches:
            plain, plain_schema = ("none", 0, False, False, batch, mode), ("none", 0, False, True, batch, mode)
            spec, spec_schema = (draft, k, False, False, batch, mode), (draft, k, False, True, batch, mode)
            name = f"{draft}_k{k}_batch{batch}"
            if spec in rounds:
                per_round[f"{name}_vs_plain"] = ratio(spec, plain)
                per_round[f"{name}_decode_vs_plain"] = ratio(spec, plain, _decode_rate)
                if spec_schema in rounds:
                    per_round[f"{name}_schema_vs_unconstrained"] = ratio(spec_schema, spec)
                    per_round[f"{name}_schema_vs_plain"] = ratio(spec_schema, plain_schema)
    return _medians(per_round)


def _compiled_vs_eager(rounds: dict[tuple, list[dict]]) -> tuple[dict, dict]:
    """Compiled over eager tokens/s for every greedy case measured in both modes, named
    `<draft>_k<k>_batch<batch>[_schema]`: the median within-round ratio, and its [min, max]."""
    per_round = {}
    for key in rounds:
        eager = (*key[:-1], "eager")
        if key[0] != "transformers" and key[-1] == "compiled" and not key[2] and eager in rounds:
            draft, k, _, constrained, batch, _ = key
            per_round[f"{draft}_k{k}_batch{batch}{'_schema' if constrained else ''}"] = sorted(
                _rate(a) / _rate(b) for a, b in zip(rounds[key], rounds[eager])
            )
    return _medians(per_round)


def _medians(per_round: dict[str, list[float]]) -> tuple[dict, dict]:
    """Each sorted list of per-round ratios as its median, and as its [min, max]."""
    ratios = {name: round(statistics.median(values), 3) for name, values in per_round.items()}
    return ratios, {name: [round(values[0], 3), round(values[-1], 3)] for name, values in per_round.items()}
