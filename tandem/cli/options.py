"""Options shared by the commands that load a model."""

from __future__ import annotations

import argparse

from tandem.assets import DEFAULT_MODEL


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model`, `--draft` and `-k`: the target, its draft and the drafts per step."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="demo-deepseek, demo-llama or a local HF directory")
    parser.add_argument(
        "--draft",
        default="auto",
        help="auto (the model's best shipped draft), none, eagle, eagle3, mtp, ngram, suffix or a directory",
    )
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
