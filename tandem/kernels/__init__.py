"""Triton kernels for the acceptance pipeline; each is tested against the torch path in tandem.decoding."""

from tandem.kernels.acceptance import accept_triton
from tandem.kernels.bitmask import apply_bitmask_triton

__all__ = ["accept_triton", "apply_bitmask_triton"]
