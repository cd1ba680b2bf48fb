"""The `tandem` command line.

Each subcommand is a module of this package exposing `add_arguments(parser)` and
`run(args) -> int`; the library code it runs lives in the packages beside it. This file only
wires them up.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tandem.cli.generate", "generate a reasoned answer for one prompt (demo model by default)"),
    "serve": ("tandem.cli.serve", "OpenAI-compatible HTTP server (chat, completions, JSON schema, tools)"),
    "bench": ("tandem.cli.bench", "speculative vs plain decoding on the demo models (JSON)"),
    "demo": ("tandem.cli.acceptance_demo", "run the acceptance pipeline on a synthetic mixed batch"),
    "eval-schemas": ("tandem.cli.eval_schemas", "check grammar backends against MaskBench schemas"),
    "train-demo": ("tandem.cli.train_demo", "train the small demo models shipped in tandem/assets"),
    "convert-gguf": ("tandem.cli.convert_gguf", "convert a llama.cpp GGUF file (Llama) into a Hugging Face directory"),
    "train-draft": ("tandem.cli.train_draft", "train an EAGLE-3 / EAGLE draft for a Llama-family target"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(module=module)
    return parser


def follows_rank_zero(args: argparse.Namespace) -> bool:
    """Under ``torchrun``, a rank other than 0 of a command that loads a parallel model follows rank 0's engine
    (which runs the command: prints, serves HTTP) until it ends: it runs that engine's forwards, or for a Llama
    model's ``data_parallel_size`` drives an engine replica of its own or runs its replica's forwards; returns
    whether this process was such a rank. Every rank (rank 0 too) refuses models that would need the other ranks
    in both roles (``tandem bench --models`` of a Llama and a DeepSeek-V3 model with ``data_parallel_size``)."""
    if "tensor_parallel_size" not in args or "RANK" not in os.environ:
        return False
    from tandem.engine.replicas import serve_replicas
    from tandem.engine.workers import ParallelConfig, follow_launcher
    from tandem.llm import resolve_device

    replicas = _runs_replicas(args)
    if os.environ["RANK"] == "0":
        return False
    device = resolve_device(getattr(args, "device", "auto"))
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if replicas:
        if int(os.environ["RANK"]) % tp == 0:  # a replica's driver
            serve_replicas(device)
        else:
            follow_launcher(ParallelConfig(tp), device)
        return True
    follow_launcher(ParallelConfig(tp, dp, args.enable_expert_parallel), device)
    return True


def _runs_replicas(args: argparse.Namespace) -> bool:
    """Whether the command's models run ``data_parallel_size`` as engine replicas (Llama) rather than as one
    engine's data-parallel ranks (DeepSeek-V3); ``ValueError`` when its models differ in that."""
    from tandem.llm import resolve_model
    from tandem.models.loading import read_config

    if args.data_parallel_size == 1:
        return False
    models = [args.model] if "model" in args else args.models
    revision = getattr(args, "revision", None)
    kinds = {model: read_config(resolve_model(model, revision)).get("model_type") == "llama" for model in models}
    if len(set(kinds.values())) > 1:
        llama = ", ".join(model for model, replicas in kinds.items() if replicas)
        others = ", ".join(model for model, replicas in kinds.items() if not replicas)
        raise ValueError(
            f"under torchrun, data_parallel_size={args.data_parallel_size} runs Llama models as engine replicas and "
            f"DeepSeek-V3 models as one engine's ranks, which the other ranks cannot both follow: run {llama} and "
            f"{others} in separate torchrun jobs"
        )
    return next(iter(kinds.values()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Parse the command name first, then let its module add its own options.
    known, _ = parser.parse_known_args(argv[:1] or ["--help"])
    module = importlib.import_module(known.module)
    sub = argparse.ArgumentParser(prog=f"tandem {known.command}", description=COMMANDS[known.command][1])
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        if follows_rank_zero(args):  # torchrun's other ranks run rank 0's forwards, not the command
            return 0
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError) as error:  # bad input (tandem's own errors are ValueErrors): say
        sub.exit(2, f"{sub.prog}: error: {error}\n")  # what and where, as argparse does, without a traceback
