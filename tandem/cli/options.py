"""Options shared by the commands that load a model."""

from __future__ import annotations

import argparse

from tandem.assets import DEFAULT_MODEL
from tandem.engine.graphs import GRAPH_MODES


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (argparse names the option when it is not)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model`, `--revision`, `--draft`, `-k`, `--adaptive`, `--graph-mode`, `--async-scheduling`, `--lookahead` and
    the parallel layout: the target (and its hub revision), its draft, the drafts per step, how steps run and over how
    many processes."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="demo-deepseek, demo-llama, a local HF directory or .gguf file, or org/name",
    )
    parser.add_argument(
        "--revision", default=None, help="the hub revision (branch, tag or commit) of an org/name model"
    )
    parser.add_argument(
        "--draft",
        default="auto",
        help="auto (the model's best shipped draft), none, eagle, eagle3, mtp, ngram, suffix or a directory",
    )
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="choose each greedy row's drafts (0..k) every step so speculation never costs time (--no-adaptive: k)",
    )
    add_graph_mode_argument(parser)
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each plain decode step before reading the last one's tokens (a model without draft: --draft "
        "none; default: on for one in graph mode on CUDA)",
    )
    parser.add_argument(
        "--lookahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a chained draft (eagle, eagle3, mtp) in graph mode proposes right after the verify, before the host "
        "reads it (default: on CUDA)",
    )
    add_parallel_arguments(parser)


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tensor-parallel-size`, `--data-parallel-size`, `--enable-expert-parallel` (`tandem.LLM`'s)."""
    group = parser.add_argument_group("parallelism (one process per rank; tandem starts them, or torchrun does)")
    group.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="Llama: ranks splitting heads, MLP columns and vocabulary"
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="DeepSeek-V3: ranks running attention over their own rows; Llama: engine replicas, each of "
        "--tensor-parallel-size ranks (requests balanced)",
    )
    group.add_argument(
        "--enable-expert-parallel", action="store_true", help="DeepSeek-V3: whole routed experts per rank"
    )


def parallel_settings(args: argparse.Namespace) -> dict:
    """The parallel layout of the command line, as `tandem.LLM` keyword arguments."""
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
    }


def add_graph_mode_argument(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """`--graph-mode`: one mode, or with `several` a list of modes to measure side by side."""
    parser.add_argument(
        "--graph-mode",
        choices=GRAPH_MODES,
        nargs="+" if several else None,
        default=["auto"] if several else "auto",
        help="eager: op by op; compiled: decode, verify and draft steps as compiled graphs (CUDA graphs on "
        "a GPU, inductor on the CPU); auto: the default for the device"
        + ("; several are measured interleaved, with compiled/eager ratios" if several else ""),
    )
