"""`tandem train-demo`: build the tokenizer and train the demo models shipped in `tandem/assets/`
(`tandem.demo.train` for the tokenizer and targets, `tandem.demo.drafts` for the drafts)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tandem.assets import ASSETS_DIR
from tandem.demo.drafts import train_draft
from tandem.demo.train import (
    DEFAULT_STEPS,
    DRAFTS,
    SIZES,
    TARGETS,
    TrainSettings,
    load_or_train_tokenizer,
    train_target,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainSettings(steps=0)
    parser.add_argument("--out", type=Path, default=ASSETS_DIR, help="assets directory (default: tandem/assets)")
    parser.add_argument(
        "--only",
        choices=["tokenizer", *TARGETS, *DRAFTS],
        help="one stage; a target reuses OUT/tokenizer, a draft its trained target in OUT",
    )
    parser.add_argument("--steps", type=int, help=f"optimizer steps per target (default: {DEFAULT_STEPS})")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed, help="model init and corpus stream seed")
    parser.add_argument("--size", choices=sorted(SIZES), default=defaults.size, help="'tiny' for smoke tests")
    parser.add_argument(
        "--eval-examples", type=int, default=defaults.eval_examples, help="held-out prompts checked after training"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    tokenizer = load_or_train_tokenizer(args.out, args.size, retrain=args.only in (None, "tokenizer"))
    if args.only == "tokenizer":
        return 0
    for stage in [args.only] if args.only else [*TARGETS, *DRAFTS]:
        settings = TrainSettings(
            steps=args.steps or DEFAULT_STEPS[stage],
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            size=args.size,
            eval_examples=args.eval_examples,
        )
        if stage in DRAFTS:
            record = train_draft(stage, tokenizer, args.out, settings)
            print(
                f"{stage} draft of {record['target']}: loss {record['loss_start']} -> {record['loss_end']}, "
                f"top-1 agreement by depth {record['train_top1_agreement_by_depth']}, {record['wall_time_s']} s"
            )
            continue
        record = train_target(stage, tokenizer, args.out / TARGETS[stage], settings)
        heldout = record["heldout"]
        print(
            f"{record['target']}: loss {record['loss_start']} -> {record['loss_end']}, "
            f"held-out valid {heldout['valid']}/{heldout['total']} (exact {heldout['exact']}), "
            f"{record['dtype']}, {record['wall_time_s']} s"
        )
    return 0
