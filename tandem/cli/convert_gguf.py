"""`tandem convert-gguf FILE OUT_DIR`: a llama.cpp GGUF file of a Llama-architecture model as the Hugging Face
directory that `LLM`, `--model` and transformers load (`tandem.models.gguf`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.models.gguf import convert_gguf
from tandem.models.loading import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="the .gguf file (F32, F16, BF16 or any type gguf dequantizes)")
    parser.add_argument("out_dir", type=Path, help="the directory to write (new or empty)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="of the written weights (default: the file's float type; bfloat16 for a quantized file)",
    )


def run(args: argparse.Namespace) -> int:
    out = convert_gguf(args.file, args.out_dir, dtype=args.dtype)
    print(f"{args.file} -> {out}")
    return 0
