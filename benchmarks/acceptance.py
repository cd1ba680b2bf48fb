"""Time `accept` on this machine: B in {1, 16, 64}, k = 4, V in {32k, 128k}; greedy,
stochastic and masked batches. Prints one JSON object (the last line of stdout).

Baseline in the same run: `sample` over the same B*(k+1) positions (what plain decoding
pays to sample that many tokens, with the same settings and masks); `vs_plain` is the ratio.

    python benchmarks/acceptance.py [--min-run-time S] [--vocab 32000 128256] [--batch 1 16 64]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform

import torch
from torch.utils.benchmark import Timer

from tandem.core.bitmask import pack_bitmask
from tandem.decoding import SamplingTensors, accept, sample


def _case(kind: str, batch: int, k: int, vocab: int) -> tuple[tuple, dict]:
    generator = torch.Generator().manual_seed(0)
    # LM-like: a low background plus a few strongly preferred tokens per position, so the
    # top token typically holds 30-90% of the mass.
    logits = torch.randn(batch, k + 1, vocab, generator=generator) * 1.5
    favourites = torch.randint(vocab, (batch, k + 1, 8), generator=generator)
    logits.scatter_add_(-1, favourites, 10 + 6 * torch.rand(batch, k + 1, 8, generator=generator))
    drafts = torch.randint(vocab, (batch, k), generator=generator)
    drafts[:, :2] = logits[:, :2].argmax(-1)  # some acceptances, so every code path runs
    options: dict = {}
    if kind != "greedy":
        options["sampling"] = SamplingTensors.full(batch, temperature=0.8, top_p=0.95, seed=torch.arange(batch))
        options["draft_probs"] = torch.randn(batch, k, vocab, generator=generator).softmax(-1)
    if kind == "masked":
        options["bitmask"] = pack_bitmask(torch.rand(batch, k + 1, vocab, generator=generator) < 0.3)
    return (logits, drafts), options


def _plain_sampling(logits: torch.Tensor, options: dict, k: int):
    """`sample` over every one of the B*(k+1) positions, with the same settings and masks."""
    flat = logits.flatten(0, 1)
    sampling = options.get("sampling")
    sampling = None if sampling is None else sampling.repeat_rows(k + 1)
    bitmask = options.get("bitmask")
    bitmask = None if bitmask is None else bitmask.flatten(0, 1)
    return lambda: sample(flat, sampling, bitmask)


def _median_seconds(fn, min_run_time: float) -> float:
    """torch's timer: a warm-up, then blocks of calls for `min_run_time` seconds; the median block's time per call."""
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_000, 128_256])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds timed per case")
    args = parser.parse_args()
    results = []
    for vocab in args.vocab:
        for batch in args.batch:
            for kind in ("greedy", "stochastic", "masked"):
                inputs, options = _case(kind, batch, args.k, vocab)
                seconds = _median_seconds(functools.partial(accept, *inputs, **options), args.min_run_time)
                plain = _plain_sampling(inputs[0], options, args.k)
                plain_seconds = _median_seconds(plain, args.min_run_time)
                row = {
                    "kind": kind,
                    "batch": batch,
                    "k": args.k,
                    "vocab": vocab,
                    "median_ms": round(seconds * 1e3, 3),
                    "plain_sample_ms": round(plain_seconds * 1e3, 3),
                    "vs_plain": round(seconds / plain_seconds, 3),
                }
                results.append(row)
                print(
                    f"{kind:10s} B={batch:3d} V={vocab:6d}  accept {row['median_ms']:9.3f} ms   "
                    f"sample x(k+1) {row['plain_sample_ms']:9.3f} ms   ratio {row['vs_plain']:.2f}",
                    flush=True,
                )
    print(
        json.dumps(
            {
                "benchmark": "accept",
                "device": "cpu",
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
