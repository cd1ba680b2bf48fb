"""`tandem generate`: one prompt through the chat template, printing the reasoning and the answer."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tandem.cli.options import add_model_arguments, parallel_settings
from tandem.decoding.params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompt", nargs="?", default="Classify the sentiment of this review: I was delighted with the toaster."
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--schema", help="a JSON schema the answer must follow: a file, or the schema itself (text starting with '{')"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from tandem.llm import LLM, best_draft, resolve_model

    schema = _read_schema(args.schema) if args.schema else None
    draft = {"auto": best_draft(resolve_model(args.model, args.revision)), "none": None}.get(args.draft, args.draft)
    llm = LLM(
        args.model,
        draft,
        num_speculative_tokens=args.num_speculative_tokens,
        adaptive=args.adaptive,
        graph_mode=args.graph_mode,
        async_scheduling=args.async_scheduling,
        lookahead=args.lookahead,
        revision=args.revision,
        **parallel_settings(args),
    )
    params = SamplingParams(
        temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens, json_schema=schema
    )
    out = llm.chat([{"role": "user", "content": args.prompt}], params)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "draft": draft,
                    "reasoning": out.reasoning,
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                    "stats": out.stats.as_dict(),
                }
            )
        )
        return 0
    print(f"[{args.model} + {draft or 'no draft'}, k={args.num_speculative_tokens}]", file=sys.stderr)
    if out.reasoning:
        print(f"<think>{out.reasoning}</think>")
    print(out.text)
    stats = out.stats
    print(
        f"[{out.finish_reason}; {len(out.token_ids)} tokens in {stats.steps} steps, "
        f"mean accepted length {stats.mean_accepted_length:.2f}]",
        file=sys.stderr,
    )
    return 0


def _read_schema(value: str) -> dict:
    """The JSON schema in the file ``--schema`` names, or given inline (text starting with ``{`` that names no file)."""
    inline = not os.path.isfile(value) and value.lstrip().startswith("{")
    try:
        text = value if inline else Path(value).read_text()
    except OSError as error:
        raise ValueError(
            f"--schema {value}: {error.strerror} (nor a schema inline: text starting with '{{')"
        ) from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--schema {'inline' if inline else value}: not JSON ({error})") from error
