"""Kernel tests run on the GPU when there is one, else on the CPU under Triton's interpreter.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels, i.e. before
tandem.kernels is first imported; this conftest is loaded before the test modules here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
except ImportError:  # the kernels need the [gpu] extra
    collect_ignore_glob = ["test_*.py"]
