"""`tandem serve`: the OpenAI-compatible server in the foreground."""

from __future__ import annotations

import argparse

import uvicorn

from tandem.cli.options import add_model_arguments
from tandem.serve.server import SUFFIX_STORE_TOKENS, build_app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    parser.add_argument(
        "--suffix-store-tokens",
        type=int,
        default=SUFFIX_STORE_TOKENS,
        help="with --draft suffix: tokens of finished requests (prompt and output) kept for later requests to "
        "draft from, oldest out first (0: none)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def run(args: argparse.Namespace) -> int:
    draft = None if args.draft == "none" else args.draft
    app = build_app(
        args.model,
        draft,
        args.num_speculative_tokens,
        args.served_model_name,
        args.max_num_seqs,
        args.graph_mode,
        args.suffix_store_tokens,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
