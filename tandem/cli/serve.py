"""`tandem serve`: the OpenAI-compatible server in the foreground."""

from __future__ import annotations

import argparse
import os
import sys

from tandem.cli.options import add_model_arguments
from tandem.serve.config import API_KEY_ENV, ServeConfig

# The `serve` extra's modules: without them the command says how to install them, not a traceback.
SERVE_MODULES = ("fastapi", "uvicorn", "starlette", "prometheus_client")
INSTALL_HINT = 'pip install "tandem[serve]" (from a checkout: pip install -e ".[serve]")'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServeConfig()
    add_model_arguments(parser)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="requests decoded together")
    parser.add_argument(
        "--suffix-store-tokens",
        type=int,
        default=defaults.suffix_store_tokens,
        help="with --draft suffix: tokens of finished requests (prompt and output) kept for later requests to "
        "draft from, oldest out first (0: none)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        default=defaults.kv_cache_memory,
        help="bytes of the paged KV cache per rank, target and draft (default: max-num-seqs rows of the whole context)",
    )
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="positions per KV cache block")
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse cached KV blocks of earlier requests' common prefixes",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="tokens one step verifies and prefills at most; a longer prompt prefills in chunks between the "
        "other rows' steps (0: no chunking)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on every /v1 route (default: ${API_KEY_ENV}; unset: open); "
        "/health and /metrics stay open",
    )
    limits = parser.add_argument_group("limits (each refused with a 4xx error naming it)")
    limits.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes, help="request body size (413)")
    limits.add_argument(
        "--max-new-tokens",
        type=int,
        default=defaults.max_new_tokens,
        help="max_tokens a request may ask for, and the default of one that asks none (400; default: the context)",
    )
    limits.add_argument(
        "--max-schema-bytes", type=int, default=defaults.max_schema_bytes, help="a JSON schema's size as JSON (400)"
    )
    limits.add_argument(
        "--max-schema-depth",
        type=int,
        default=defaults.max_schema_depth,
        help="a JSON schema's nesting of objects and arrays (400)",
    )
    limits.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="requests waiting for the engine at once (429 beyond)",
    )
    limits.add_argument(
        "--queue-timeout-s",
        type=float,
        default=defaults.queue_timeout_s,
        help="how long a request may wait for the engine (503 after)",
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the command line; the API key from $TANDEM_API_KEY when --api-key is not given."""
    return ServeConfig(
        revision=args.revision,
        num_speculative_tokens=args.num_speculative_tokens,
        adaptive=args.adaptive,
        max_num_seqs=args.max_num_seqs,
        graph_mode=args.graph_mode,
        async_scheduling=args.async_scheduling,
        lookahead=args.lookahead,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens or None,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        suffix_store_tokens=args.suffix_store_tokens,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        max_new_tokens=args.max_new_tokens,
        max_schema_bytes=args.max_schema_bytes,
        max_schema_depth=args.max_schema_depth,
        max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout_s,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        import uvicorn

        from tandem.serve.server import build_app
    except ModuleNotFoundError as error:
        if error.name not in SERVE_MODULES:
            raise
        print(f"tandem serve: the server needs {error.name}, which is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 1
    app = build_app(args.model, None if args.draft == "none" else args.draft, config)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
