"""Options shared by the commands that load a model."""

from __future__ import annotations

import argparse

from tandem.assets import DEFAULT_MODEL
from tandem.engine.graphs import GRAPH_MODES


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model`, `--revision`, `--draft`, `-k` and `--graph-mode`: the target (and its hub revision), its
    draft, the drafts per step and how steps run."""
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
    add_graph_mode_argument(parser)


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
