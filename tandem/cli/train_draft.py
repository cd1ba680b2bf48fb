"""`tandem train-draft`: train an EAGLE-3 or EAGLE draft for a Llama-family target (`tandem.training`).

The target answers the prompts itself (self-distillation), the draft learns those answers with
training-time test, and OUT receives the published draft layout (`LLM(target, draft=OUT)` reads
it), the trainer state (`--resume`) and `tandem_train.json`, whose summary is printed as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tandem.llm import resolve_device, resolve_model
from tandem.training.data import DEFAULT_PROMPTS, Chat, read_prompts, split_heldout
from tandem.training.trainer import DraftSettings, train_draft

DEMO_PROMPTS = "demo"  # --prompts value: the demo corpus's chats (the shipped demo drafts' training prompts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DraftSettings()
    parser.add_argument("--target", required=True, help="target: a shipped demo name or a Hugging Face directory")
    parser.add_argument("--kind", choices=["eagle3", "eagle"], default=defaults.kind)
    parser.add_argument("--out", type=Path, required=True, help="draft directory to write")
    parser.add_argument(
        "--prompts",
        help=f"chat prompts, jsonl (default: the shipped {DEFAULT_PROMPTS.name}); "
        f"'{DEMO_PROMPTS}': N demo-corpus chats (train split; held out: its heldout split)",
    )
    parser.add_argument("--num-prompts", type=int, help="train on the first N prompts (with --prompts demo: N chats)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--ttt-depth", type=int, default=defaults.ttt_depth, help="chained depths trained")
    parser.add_argument(
        "--draft-vocab-size", type=int, help="EAGLE-3: the most frequent generated tokens (default: full vocab)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, help="self-distilled answers")
    parser.add_argument("--temperature", type=float, default=defaults.temperature, help="of the answers (0: greedy)")
    parser.add_argument("--heldout", type=int, default=defaults.heldout, help="prompts held out for evaluation")
    parser.add_argument("--num-speculative-tokens", type=int, default=defaults.num_speculative_tokens, help="eval k")
    parser.add_argument("--save-every", type=int, default=defaults.save_every, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--resume", action="store_true", help="continue from OUT's trainer state")
    parser.add_argument("--pause-at", type=int, help="stop after this step, state saved (resume with --resume)")
    parser.add_argument("--baseline-draft", type=Path, help="a draft also evaluated on the held-out prompts")
    parser.add_argument("--threads", type=int, help="torch CPU threads")


def prompt_sets(args: argparse.Namespace) -> tuple[list[Chat], list[Chat]]:
    """(train, held-out) chats from --prompts, --num-prompts and --heldout."""
    if args.prompts == DEMO_PROMPTS:
        from tandem.demo.corpus import generate_examples

        count = args.num_prompts or args.steps * args.batch_size // 2

        def chats(n: int, split: str) -> list[Chat]:
            return [Chat(e.messages, e.tools) for e in generate_examples(n, seed=args.seed, split=split)]

        return chats(count, "train"), chats(args.heldout, "heldout")
    train, heldout = split_heldout(read_prompts(args.prompts or DEFAULT_PROMPTS), args.heldout, args.seed)
    return train[: args.num_prompts], heldout


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    train, heldout = prompt_sets(args)
    settings = DraftSettings(
        kind=args.kind,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        ttt_depth=args.ttt_depth,
        draft_vocab_size=args.draft_vocab_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        heldout=len(heldout),
        num_speculative_tokens=args.num_speculative_tokens,
        save_every=args.save_every,
    )
    record = train_draft(
        resolve_model(args.target),
        args.out,
        train,
        heldout,
        settings,
        device=resolve_device(args.device),
        resume=args.resume,
        pause_at=args.pause_at,
        baseline_draft=args.baseline_draft,
    )
    print(json.dumps(record))
    return 0
