"""Kernels: Triton ones for the acceptance pipeline, each tested against the torch path in
tandem.decoding, and paged attention, tested against tandem.models.attention's gather + sdpa; and
a C one for small-batch linears on the CPU (:mod:`tandem.kernels.cpu_linear`).

The Triton kernels are imported on first use: importing Triton fixes ``TRITON_INTERPRET``, and
the models import the CPU kernel without needing Triton at all.
"""

import importlib
from typing import Any

_TRITON = {
    "accept_triton": "tandem.kernels.acceptance",
    "apply_bitmask_triton": "tandem.kernels.bitmask",
    "paged_attention_triton": "tandem.kernels.paged_attention",
}

__all__ = ["accept_triton", "apply_bitmask_triton", "paged_attention_triton"]


def __getattr__(name: str) -> Any:
    if name not in _TRITON:
        raise AttributeError(f"module 'tandem.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_TRITON[name]), name)
