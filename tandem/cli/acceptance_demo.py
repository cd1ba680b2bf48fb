"""`tandem demo`: the acceptance pipeline on a synthetic batch, measured against the theory.

The target's distributions are random; the draft's are the target's, blurred by noise of a
chosen strength, so the exact expected acceptance rate sum_x min(p(x), q(x)) is known and
the measured rate of `accept` can be compared with it, row kind by row kind.
"""

from __future__ import annotations

import argparse
import json

import torch

from tandem.core.bitmask import pack_bitmask
from tandem.decoding.acceptance import accept
from tandem.decoding.params import RelaxedAcceptance, SamplingTensors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=4096, help="batch rows per kind")
    parser.add_argument("-k", type=int, default=4, help="drafts per row")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--noise", type=float, default=1.0, help="draft logit noise (0 = perfect draft)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    generator = torch.Generator().manual_seed(args.seed)
    rows, k, vocab = args.rows, args.k, args.vocab
    target_logits = torch.randn(k + 1, vocab, generator=generator) * 3
    draft_logits = target_logits[:k] + torch.randn(k, vocab, generator=generator) * args.noise
    q = draft_logits.softmax(-1)
    drafts = torch.multinomial(q, rows, replacement=True, generator=generator).T  # [rows, k]
    allowed = torch.rand(k + 1, vocab, generator=generator) < 0.5
    allowed[:, target_logits.argmax(-1)] = True  # keep the grammar compatible with the target's favourite
    seeds = torch.arange(rows)
    kinds = {
        "greedy": {"sampling": None},
        "stochastic": {"sampling": SamplingTensors.full(rows, seed=seeds), "draft_probs": q.expand(rows, -1, -1)},
        "stochastic+mask": {
            "sampling": SamplingTensors.full(rows, seed=seeds),
            "draft_probs": q.expand(rows, -1, -1),
            "bitmask": pack_bitmask(allowed).expand(rows, -1, -1),
        },
        "greedy+relaxed": {
            "in_thinking": torch.ones(rows, k + 1, dtype=torch.bool),
            "relaxed": RelaxedAcceptance(),
        },
    }
    p = target_logits.softmax(-1)
    expected = torch.minimum(p[:k], q).sum(-1)  # [k]: sum_x min(p(x), q(x)) at each position
    report = {
        "rows": rows,
        "k": k,
        "vocab": vocab,
        "noise": args.noise,
        "expected_stochastic_rate": [round(float(rate), 4) for rate in expected],
        # positions are independent here (each row's p and q do not depend on its earlier drafts), so
        # P(drafts 0..j all accepted) is the product of the rates: what "stochastic" measures
        "expected_stochastic_prefix_rate": [round(float(rate), 4) for rate in expected.cumprod(0)],
    }
    for name, options in kinds.items():
        result = accept(target_logits.expand(rows, -1, -1), drafts, **options)
        position_reached = torch.arange(k)[None] < result.num_accepted[:, None]
        report[name] = {
            "mean_accepted_length": round(float(result.num_emitted.float().mean()), 3),
            "prefix_accepted_rate": [round(float(x), 4) for x in position_reached.float().mean(0)],
        }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"accept() on {rows} rows x k={k}, vocab {vocab}, draft noise {args.noise}")
    print(f"exact stochastic acceptance rate per position, sum_x min(p, q): {report['expected_stochastic_rate']}")
    print(f"exact P(drafts 0..j all accepted) for stochastic rows: {report['expected_stochastic_prefix_rate']}")
    for name in kinds:
        print(
            f"  {name:16s} mean accepted length {report[name]['mean_accepted_length']:.3f}  "
            f"P(drafts 0..j all accepted) {report[name]['prefix_accepted_rate']}"
        )
    return 0
