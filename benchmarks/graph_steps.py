"""Engine steps against the device's clock: a step's wall time and the device's busy time, eager and graph mode.

    python benchmarks/graph_steps.py [--device cuda] [--dtype bfloat16] [--batch 1 8] [--steps 32] [--k 4]

For each demo target with its draft (demo-llama + EAGLE-3, demo-deepseek + MTP), batch size and graph mode,
the plain path (and with ``--async-scheduling`` the plain path with async scheduling, ``plain-async``) and the
speculative one (``--k`` drafts; with ``--lookahead`` also with lookahead proposals off, ``<draft>-after-commit``,
and ``lookahead_over_commit``, the tokens/s ratio of the default to it): rows that cannot finish inside the run
(``ignore_eos``,
``max_tokens`` past it) take ``--warmup`` steps, which build every graph the run
needs, then ``--steps`` timed steps. ``wall_ms`` is a step's wall time (unprofiled), ``device_ms`` the
device's busy time per step over as many further steps under the profiler (the union of kernel intervals
in its trace: the profiler slows the host, not the kernels), ``wall_over_device`` their ratio (1.0: the
device bounds the step; graph mode's goal is 1.3 at most for unconstrained steps), ``tokens_per_step`` and
``tokens_per_s``; ``graphs_built_while_timed`` must stay 0. ``speculative_over_plain`` is the tokens/s ratio
of the two paths in the same mode and batch, and ``compiled_over_eager`` that of the two modes. On a CPU
there is no device column (the host is the device). One JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch
from overlap import trace_summary
from torch.profiler import ProfilerActivity, profile

from tandem import LLM, SamplingParams
from tandem.demo.corpus import generate_examples
from tandem.llm import chat_prompt_ids
from tandem.models.loading import DTYPES

PAIRS = {"demo-llama": "eagle3", "demo-deepseek": "mtp"}


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steps(engine, steps: int) -> int:
    """Run ``steps`` engine steps; the tokens they emitted."""
    return sum(len(delta.token_ids) for _ in range(steps) for delta in engine.step())


def _device_ms(engine, steps: int, top: int = 0) -> tuple[float, dict]:
    """The device's busy milliseconds per step over ``steps`` profiled steps, and the trace's summary (with its
    ``top`` kernels)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _steps(engine, steps)
        sync(engine.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        summary = trace_summary(json.loads(path.read_text()), top)
    return summary.get("device_busy_us", 0.0) / 1000 / steps, summary


def _host_profile(engine, steps: int) -> str:
    """The 30 functions that took the most host time (their own) over ``steps`` steps under cProfile."""
    profiler = cProfile.Profile()
    profiler.runcall(_steps, engine, steps)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def measure_case(engine, prompts: list[list[int]], args) -> dict:
    """One engine's steps over ``len(prompts)`` rows that run through ``args.warmup`` steps, ``args.steps`` timed
    and as many profiled (on CUDA); ``args.k``: the most tokens a step adds to a row, less one."""
    budget = (args.warmup + 3 * args.steps) * (args.k + 1) + 1  # timed, profiled, host-profiled
    params = SamplingParams(max_tokens=budget, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    _steps(engine, args.warmup)
    runner = engine.runner
    built = runner.compile_s if runner is not None else 0.0
    sync(engine.device)
    start = time.perf_counter()
    tokens = _steps(engine, args.steps)
    sync(engine.device)
    wall_ms = (time.perf_counter() - start) * 1000 / args.steps
    row = {
        "wall_ms": round(wall_ms, 3),
        "tokens_per_step": round(tokens / args.steps, 3),
        "tokens_per_s": round(tokens * 1000 / wall_ms / args.steps, 1),
        "graphs_built_while_timed": int(runner is not None and runner.compile_s != built),
    }
    if engine.device.type == "cuda":
        top = getattr(args, "top_kernels", 0)
        device_ms, summary = _device_ms(engine, args.steps, top)
        row |= {"device_ms": round(device_ms, 3), "wall_over_device": round(wall_ms / max(device_ms, 1e-9), 3)}
        if top:  # per step
            row["kernels_per_step"] = round(summary["kernels"] / args.steps, 1)
            row["top_kernels_us_per_step"] = {
                name: round(us / args.steps, 1) for name, (_, us) in summary["top_kernels"].items()
            }
    if runner is not None:
        row |= {"compile_s": round(runner.compile_s, 2), "graph_mib": round(runner.graph_bytes / 2**20, 1)}
    if getattr(args, "host_profile", None) is not None:
        args.host_profile.write(_host_profile(engine, args.steps))
    for request_id in ids:  # the next batch size starts from an empty engine
        engine.abort(request_id)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(PAIRS), default=sorted(PAIRS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--graph-mode", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=8, help="steps before timing: prefill and graph builds")
    parser.add_argument("--steps", type=int, default=32, help="timed steps (and as many profiled)")
    parser.add_argument("--host-profile", type=Path, default=None, help="a file for each case's cProfile top 30")
    parser.add_argument("--async-scheduling", action="store_true", help="also plain decoding with async scheduling")
    parser.add_argument("--lookahead", action="store_true", help="also speculative steps without lookahead proposals")
    args = parser.parse_args()
    if args.host_profile is not None:
        args.host_profile = args.host_profile.open("w")
    torch.manual_seed(0)
    report = {"benchmark": "graph_steps", "device": args.device, "dtype": args.dtype, "k": args.k, "cases": []}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(args.device)
    examples = generate_examples(max(args.batch), seed=1, split="heldout")
    for model in args.models:
        speculative = PAIRS[model]
        paths = [("plain", None, False, None), *([("plain-async", None, True, None)] if args.async_scheduling else [])]
        paths.append((speculative, speculative, False, None))
        if args.lookahead:
            paths.append((f"{speculative}-after-commit", speculative, False, False))
        for path, draft, overlap, lookahead in paths:
            for mode in args.graph_mode:
                if lookahead is not None and mode == "eager":
                    continue  # lookahead proposals are graph mode's
                llm = LLM(
                    model,
                    draft,
                    num_speculative_tokens=args.k,
                    device=args.device,
                    dtype=DTYPES[args.dtype],
                    max_num_seqs=max(args.batch),
                    graph_mode=mode,
                    async_scheduling=overlap,
                    lookahead=lookahead,
                )
                prompts = [chat_prompt_ids(llm.tokenizer, ex.messages, ex.tools) for ex in examples]
                for batch in args.batch:
                    row = {"model": model, "draft": path, "graph_mode": mode, "batch": batch}
                    if args.host_profile is not None:
                        args.host_profile.write(f"\n==== {json.dumps(row)}\n")
                    row |= measure_case(llm.engine, prompts[:batch], args)
                    report["cases"].append(row)
                    print(json.dumps(row), flush=True)
                llm.close()
    report["ratios"] = _ratios(report["cases"])
    print(json.dumps(report))


def _ratios(cases: list[dict]) -> list[dict]:
    """Speculative (and async plain) over plain (same model, mode, batch) and compiled over eager (same model, path,
    batch)."""
    rate = {(c["model"], c["draft"], c["graph_mode"], c["batch"]): c["tokens_per_s"] for c in cases}
    ratios = []
    for (model, draft, mode, batch), value in rate.items():
        plain = rate.get((model, "plain", mode, batch))
        if draft == "plain-async" and plain:
            ratios.append(
                {"model": model, "graph_mode": mode, "batch": batch, "async_over_sync": round(value / plain, 3)}
            )
        elif draft.endswith("-after-commit"):
            ahead = rate.get((model, draft.removesuffix("-after-commit"), mode, batch))
            ratios.append({"model": model, "draft": draft, "graph_mode": mode, "batch": batch,
                           "lookahead_over_commit": None if ahead is None else round(ahead / value, 3)})  # fmt: skip
        elif draft != "plain" and plain:
            ratios.append({"model": model, "draft": draft, "graph_mode": mode, "batch": batch,
                           "speculative_over_plain": round(value / plain, 3)})  # fmt: skip
        eager = rate.get((model, draft, "eager", batch))
        if mode == "compiled" and eager:
            ratios.append({"model": model, "draft": draft, "batch": batch,
                           "compiled_over_eager": round(value / eager, 3)})  # fmt: skip
    return ratios


if __name__ == "__main__":
    main()
