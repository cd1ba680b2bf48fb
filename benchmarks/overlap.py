"""Do the grammar masks reach the GPU without stalling it? Profiles engine steps under a JSON schema.

    python benchmarks/overlap.py [--model demo-llama] [--drafts eagle3 ngram] [--batch 1 8] [--trace DIR]

For each draft and batch size (greedy, held-out demo prompts, each with its task's schema): tokens/s
with and without the schemas, interleaved over `--repeats` rounds, and a torch.profiler trace of
one constrained generation. From the trace: each stream's host-to-device copies (count, time), the
fraction of their time during which a kernel ran on another stream (the copy hidden behind
compute), and the device's busy fraction (union of kernel time over the profiled window: a host
that stalls on masks leaves the device idle). Drafts that follow the grammar (EAGLE, EAGLE-3, MTP)
build the verify masks while drafting; the n-gram draft's proposals are walked under the grammar too
(grammar-forced drafting, `EngineConfig.forced_drafts`), so `MaskPipeline`'s worker thread and side
stream build the masks of prefills and of rows whose drafts were cut. JSON on stdout; `--trace` also
writes each chrome trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from tandem.cli.bench import measure
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.llm import LLM, chat_prompt_ids


def _intervals(events: list[dict]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events)


def _covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Time within [start, end) covered by the union of `intervals` (sorted by start)."""
    covered, reach = 0.0, start
    for a, b in intervals:
        if a >= end:
            break
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered, reach = covered + b - a, b
    return covered


def trace_summary(trace: dict, top: int = 0) -> dict:
    """Copies per stream and their overlap with kernels on other streams; the device's busy fraction; with ``top``,
    the kernels that took the most device time (name: launches and microseconds, in all)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    kernels = [e for e in events if e["cat"] == "kernel"]
    copies = [e for e in events if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
    streams: dict[int, dict] = {}
    for stream in {copy["args"].get("stream") for copy in copies}:
        others = _intervals([k for k in kernels if k["args"].get("stream") != stream])  # kernels it may hide behind
        row = streams[stream] = {"copies": 0, "copy_us": 0.0, "overlapped_us": 0.0}
        for copy in (c for c in copies if c["args"].get("stream") == stream):
            row["copies"] += 1
            row["copy_us"] += copy["dur"]
            row["overlapped_us"] += _covered(copy["ts"], copy["ts"] + copy["dur"], others)
    for row in streams.values():
        row["overlapped_fraction"] = round(row.pop("overlapped_us") / max(row["copy_us"], 1e-9), 3)
        row["copy_us"] = round(row["copy_us"], 1)
    span = _intervals(kernels + copies)
    if not span:
        return {"kernels": 0}  # no device activity (a CPU run)
    start, end = span[0][0], max(b for _, b in span)
    busy = _covered(start, end, _intervals(kernels))
    return {
        "kernels": len(kernels),
        "window_us": round(end - start, 1),
        "device_busy_fraction": round(busy / (end - start), 3),
        "device_busy_us": round(busy, 1),
        "htod_copies_by_stream": {str(s): row for s, row in streams.items()},
    } | ({"top_kernels": _heaviest(kernels, top)} if top else {})


def _heaviest(kernels: list[dict], top: int) -> dict[str, list]:
    """The ``top`` kernel names by device time in all: name (its first 80 characters) -> [launches, microseconds]."""
    by_name: dict[str, list] = {}
    for kernel in kernels:
        entry = by_name.setdefault(kernel["name"][:80], [0, 0.0])
        entry[0] += 1
        entry[1] += kernel["dur"]
    heaviest = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {name: [n, round(us, 1)] for name, (n, us) in heaviest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llama")
    parser.add_argument("--drafts", nargs="+", default=["eagle3", "ngram"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trace", type=Path, default=None, help="directory for the chrome traces")
    args = parser.parse_args()
    examples = generate_examples(max(args.batch), seed=1, split="heldout")
    report = {"model": args.model, "device": args.device, "runs": []}
    for draft in args.drafts:
        llm = LLM(args.model, draft, device=args.device, max_num_seqs=max(args.batch))
        prompts = [chat_prompt_ids(llm.tokenizer, ex.messages, ex.tools) for ex in examples]
        schemas = [TASK_FAMILIES[ex.family].schema for ex in examples]
        for batch in args.batch:
            group = list(range(batch))
            runs = {"schema": [], "free": []}
            for schema in (schemas, [None] * batch):  # warm-up: compiles kernels and grammars
                measure(llm, prompts, schema, group, 8)
            for _ in range(args.repeats):
                runs["schema"].append(measure(llm, prompts, schemas, group, args.max_tokens))
                runs["free"].append(measure(llm, prompts, [None] * batch, group, args.max_tokens))
            rate = {name: [r["generated"] / r["seconds"] for r in values] for name, values in runs.items()}
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                measure(llm, prompts, schemas, group, args.max_tokens)
            with tempfile.TemporaryDirectory() as tmp:
                path = (args.trace or Path(tmp)) / f"{args.model}-{draft}-b{batch}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(path))
                summary = trace_summary(json.loads(path.read_text()))
            report["runs"].append(
                {
                    "draft": draft,
                    "batch": batch,
                    "tokens_per_s_schema": round(max(rate["schema"]), 1),
                    "tokens_per_s_free": round(max(rate["free"]), 1),
                    "schema_vs_free": round(statistics.median(s / f for s, f in zip(rate["schema"], rate["free"])), 3),
                    **summary,
                }
            )
            print(json.dumps(report["runs"][-1]), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
