"""RMSNorm, normalised in float32 like HF's LlamaRMSNorm, one path per dtype.

- float32 input and weight (the CPU's dtype): on the CPU the C kernel of :mod:`tandem.kernels.cpu_norm`, one
  call where torch takes six ops; elsewhere (and without the kernel, or while ``torch.compile`` traces) HF's
  arithmetic op for op, written with in-place ops (on the CPU that is fewer ops than ``F.rms_norm``, and
  ``x * x`` is cheaper there than ``x.pow(2)``).
- narrower inputs: one ``F.rms_norm`` call with the weight (one fused kernel on a GPU, float32
  inside, one rounding at the end) where HF's upcast, normalise, downcast and scale launch four
  kernels; a small model's decode step runs a norm twice per layer, so that adds up.

Invariant: the float32 path is HF's result, the C kernel's up to the order of its sum of squares (fixed by the
width alone, so a row's result does not depend on its batch); the narrower path is the float32 result rounded
once (HF's rounds twice, after normalising and after scaling).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.kernels import cpu_norm
from tandem.models.layers import Layer


class RMSNorm(Layer):
    """``weight * x / rms(x)``, normalised in float32. ``x: [..., D]``."""

    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight  # read once: a parameter is found through nn.Module.__getattr__
        if cpu_norm.applies(x, weight):
            return cpu_norm.rms_norm(x, weight, self.eps)
        if x.dtype == weight.dtype == torch.float32:
            scale = (x * x).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            return (x * scale).mul_(weight)
        return F.rms_norm(x, x.shape[-1:], weight, self.eps)
