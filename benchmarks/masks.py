"""Mask-walk speed per backend, and how much of it the overlap pipeline hides.

    python benchmarks/masks.py --tokenizer PATH [--maskbench DIR] [--files 40] [--batch 8] [--k 4] [--backends ...]

For MaskBench schemas every backend compiles non-strict, it replays each valid instance as a
speculative decode: per step the masker fills [B, k+1, W] for drafts = the next k true tokens,
then commits them. Reports microseconds per filled mask row (p50/p99) per backend, then the
step time with masks computed serially after a simulated target forward vs. overlapped with it
(`--forward-ms`, a sleep: a GPU forward leaves the CPU idle) on the chosen device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from tandem.cli.eval_schemas import instance_text
from tandem.engine.mask_pipeline import MaskPipeline
from tandem.grammars.backends import BACKENDS
from tandem.grammars.compiler import compile_grammar
from tandem.grammars.errors import GrammarError
from tandem.grammars.masks import SpeculativeMasker
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.tokenizer import GrammarTokenizer


def load_cases(tokenizer, maskbench: Path, limit: int):
    """(schema spec, token ids of one valid instance) for the first `limit` usable files."""
    cases = []
    for path in sorted(maskbench.glob("*.json")):
        case = json.loads(path.read_text())
        valid = [t for t in case["tests"] if t["valid"]]
        if valid:
            cases.append(
                (
                    GrammarSpec.json_schema(case["schema"], strict=False),
                    tokenizer.encode(instance_text(valid[0]["data"])) + [tokenizer.eos_token_id],
                )
            )
        if len(cases) == limit:
            break
    return cases


def batches(tokenizer, backend, cases, batch_size):
    """Yield lists of (new_matcher, tokens) of `batch_size` rows the backend compiles and accepts."""
    rows = []
    for spec, tokens in cases:
        try:
            new_matcher = compile_grammar(spec, tokenizer, backend).new_matcher
        except GrammarError:
            continue
        matcher = new_matcher()
        if all(matcher.accept_token(t) for t in tokens):
            rows.append((new_matcher, tokens))
        if len(rows) == batch_size:
            yield rows
            rows = []
    if rows:
        yield rows


def steps(masker, rows, k):
    """Yield (row_ids, drafts [B, k]) along the rows' true tokens; commits after each yield."""
    for i, (new_matcher, _) in enumerate(rows):
        masker.add_row(i, new_matcher())
    position = 0
    longest = max(len(tokens) for _, tokens in rows)
    while position < longest:
        live = [i for i, (_, tokens) in enumerate(rows) if position < len(tokens)]
        drafts = [(rows[i][1][position : position + k] + [0] * k)[:k] for i in live]
        yield live, torch.tensor(drafts, dtype=torch.int64).view(len(live), k)
        for i in live:
            masker.commit(i, rows[i][1][position : position + k])
        position += k


def time_backend(tokenizer, backend, cases, batch_size, k):
    per_row = []
    for rows in batches(tokenizer, backend, cases, batch_size):
        masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
        bitmask = torch.zeros(batch_size, k + 1, masker.width, dtype=torch.int32)
        in_thinking = torch.zeros(batch_size, k + 1, dtype=torch.bool)
        for live, drafts in steps(masker, rows, k):
            start = time.perf_counter()
            masker.fill(live, drafts, bitmask, in_thinking)
            per_row.append((time.perf_counter() - start) / (len(live) * (k + 1)))
    return per_row


def time_overlap(tokenizer, backend, cases, batch_size, k, forward_s, device):
    rows = next(batches(tokenizer, backend, cases, batch_size), None)
    if rows is None:
        return None
    results = {}
    for overlapped in (False, True):
        masker = SpeculativeMasker(tokenizer.vocab_size, len(tokenizer.hf))
        pipeline = MaskPipeline(masker, batch_size, k, device, worker=True)  # the sleep leaves the host idle
        step_times = []
        for live, drafts in steps(masker, rows, k):
            start = time.perf_counter()
            if overlapped:
                handle = pipeline.submit(live, drafts)
                time.sleep(forward_s)
                handle.wait()
            else:
                time.sleep(forward_s)
                pipeline.submit(live, drafts).wait()
            if device != "cpu":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
        pipeline.close()
        results["overlapped" if overlapped else "serial"] = statistics.median(step_times)
    masks = results["serial"] - forward_s
    hidden = (results["serial"] - results["overlapped"]) / masks if masks > 0 else float("nan")
    return {
        **{f"step_ms_{k_}": round(v * 1e3, 3) for k_, v in results.items()},
        "mask_ms": round(masks * 1e3, 3),
        "hidden_fraction": round(hidden, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument(
        "--maskbench", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "maskbench"
    )
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--forward-ms", type=float, default=5.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=sorted(BACKENDS))
    args = parser.parse_args()
    tokenizer = GrammarTokenizer(AutoTokenizer.from_pretrained(args.tokenizer))
    cases = load_cases(tokenizer, args.maskbench, args.files)
    report = {}
    for backend in args.backends:
        per_row = time_backend(tokenizer, backend, cases, args.batch, args.k)
        report[backend] = {
            "rows": len(per_row),
            "us_per_mask_row_p50": round(float(np.percentile(per_row, 50)) * 1e6, 1) if per_row else None,
            "us_per_mask_row_p99": round(float(np.percentile(per_row, 99)) * 1e6, 1) if per_row else None,
            "overlap": time_overlap(tokenizer, backend, cases, args.batch, args.k, args.forward_ms / 1e3, args.device),
        }
    print(json.dumps({"device": args.device, "batch": args.batch, "k": args.k, "backends": report}, indent=1))


if __name__ == "__main__":
    main()
