"""RMSNorm of float32 rows on the CPU, in C (``cpu_norm.c``): HF's arithmetic but for the order of its sum.

A decode step of a small model normalises a row twice per layer, and torch's six ops for one norm
spend most of their time in dispatch; one C call does the same arithmetic, the sum of squares
taken in an order of its own (fixed by the row's width alone, so a row's result does not depend on
its batch). Portable C, so every CPU with a C compiler at install has it. Under ``torch.compile`` the
layers keep torch's ops, which inductor fuses itself.

The extension is built at install when a C compiler is there (``pyproject.toml``); without it
:func:`available` is False and :class:`tandem.models.norm.RMSNorm` uses torch's ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    from tandem.kernels import _cpu_norm
except ImportError:  # built without a C compiler
    _cpu_norm = None

_AVAILABLE = _cpu_norm is not None


def available() -> bool:
    """True when the extension is built."""
    return _AVAILABLE


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`rms_norm` takes ``x [..., D]`` and ``weight [D]``: CPU float32 tensors, ``x``'s rows
    contiguous (a 2-D ``x`` may be a column block of a wider matrix), ``weight`` contiguous, outside
    ``torch.compile`` and with no gradient to record (the kernel has no backward)."""
    return (  # called for every norm of a step: cheapest checks first
        _AVAILABLE
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.is_cpu
        and weight.is_cpu
        and (x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= x.shape[1]))
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[0]
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x [..., D] * rsqrt(mean(x**2, -1) + eps) * weight [D]`` -> a new contiguous ``[..., D]`` float32 tensor.

    Only for inputs that :func:`applies` to; the caller checks.
    """
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dim = x.shape[-1]
    rows = out.numel() // dim
    row_stride = dim if x.is_contiguous() else x.stride(0)
    if rows:
        _cpu_norm.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, row_stride, eps)
    return out
