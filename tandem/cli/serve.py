"""`tandem serve`: the OpenAI-compatible server in the foreground."""

from __future__ import annotations

import argparse

import uvicorn

from tandem.assets import DEFAULT_MODEL
from tandem.serve.server import build_app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="demo-deepseek, demo-llama or a local HF directory")
    parser.add_argument(
        "--draft",
        default="auto",
        help="auto (the model's best shipped draft), none, eagle, eagle3, mtp, ngram or a directory",
    )
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def run(args: argparse.Namespace) -> int:
    draft = None if args.draft == "none" else args.draft
    app = build_app(args.model, draft, args.num_speculative_tokens, args.served_model_name, args.max_num_seqs)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
