"""Layers shared by the providers, and the walk from a module to its checkpoint keys.

:class:`MergedLinear` keeps several published projections that read the same input (Llama's
``q_proj``/``k_proj``/``v_proj``, SwiGLU's ``gate_proj``/``up_proj``, MLA's ``q_a_proj``/
``kv_a_proj_with_mqa``) as one weight, so one matmul serves them all (vLLM's merged
column-parallel layers). On small models most of a decode step is per-op overhead, so every
op saved counts. :func:`checkpoint_tensors` names each parameter by its checkpoint key, a merged
weight by its parts' keys, which keeps loading one pass over the module.

Matmul weights may be stored narrower than the model computes: :func:`narrow_exact_weights`
keeps in bfloat16 every one that bfloat16 holds exactly (all of a bfloat16 checkpoint's in a
float32 model), and the layers widen them per call (:func:`widened`): the float32 model's very
weights, so its results up to the order in which sums are taken (sgemm's order depends on the
weight's layout and the number of rows, the CPU kernel's is its own). A decode step reads every
weight once, and on the CPU a small model waits on the caches to deliver them: half the bytes
(the Llama demo's 27.5 MB of float32 weights become 13.8 MB, under the ~15 MB of last-level cache
one core here gets) took its decode forward from 7.2 to 6.2 ms. Narrowed matrices are stored
transposed, the layout of the CPU kernel that :func:`linear` calls for steps of a few rows, which
widens them in registers instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.kernels import cpu_linear


class Layer(nn.Module):
    """An ``nn.Module`` whose call goes straight to ``forward``. A decode step calls nine per layer,
    and ``nn.Module.__call__``'s hook dispatch (about 2 us a call) took 6% of the Llama demo's
    forward. Hooks registered on a Layer do not run."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class RMSNorm(Layer):
    """``weight * x / rms(x)``, normalised in float32 like HF's LlamaRMSNorm. ``x: [..., D]``.

    Narrower inputs take one ``F.rms_norm`` call with the weight (one fused kernel on a GPU, float32
    inside, one rounding at the end) where HF's upcast, normalise, downcast and scale launch four:
    on an H100 the Llama demo's bfloat16 decode step launched 228 kernels, 132 of them for its 33 norms.
    """

    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # HF's arithmetic in 6 ops, F.rms_norm's 8 on the CPU
            scale = (x * x).mean(-1, keepdim=True).add_(self.eps).rsqrt_()  # x * x: pow(2) is slower here
            return (x * scale).mul_(self.weight)
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


def widened(weight: Tensor, like: Tensor) -> Tensor:
    """``weight`` in ``like``'s dtype (a copy only when it is stored narrower: :func:`narrow_exact_weights`)."""
    return weight if weight.dtype == like.dtype else weight.to(like.dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` for a weight that may be stored narrower: ``x [T, in] @ weight [out, in].T -> [T, out]``.

    A few float32 rows on the CPU times a narrowed weight take the C kernel
    (:mod:`tandem.kernels.cpu_linear`): the Llama demo's forward of one token took 5.05 -> 4.72 ms,
    of five (a k = 4 verify) 7.28 -> 5.69 ms.
    """
    if cpu_linear.applies(x, weight):
        return cpu_linear.linear(x, weight, bias)
    return F.linear(x, widened(weight, x), bias)


class Linear(Layer, nn.Linear):
    """``nn.Linear`` whose weight may be stored narrower than it computes: ``x: [T, in] -> [T, out]``."""

    narrowable = ("weight",)  # the parameters `narrow_exact_weights` may store narrower

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Layer):
    """Linears over one input stored as a single ``[sum(out), in]`` weight: ``x: [T, in] -> [T, sum(out)]``,
    the parts' outputs side by side in order (``.split(self.sizes, -1)`` separates them).

    ``parts`` maps each checkpoint name (``"q_proj"``) to its output size; the checkpoint keys are
    ``{parent prefix}{name}.weight`` (and ``.bias``), as if each part were its own ``nn.Linear``.
    """

    def __init__(self, in_features: int, parts: dict[str, int], *, bias: bool = False, **factory):
        super().__init__()
        self.in_features, self.parts = in_features, dict(parts)
        self.sizes = list(self.parts.values())
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features, **factory))
        self.bias = nn.Parameter(torch.empty(sum(self.sizes), **factory)) if bias else None

    narrowable = ("weight",)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def part_tensors(self, prefix: str) -> Iterator[tuple[str, Tensor]]:
        """``(checkpoint key, view of the merged parameter)`` for each part's weight (and bias)."""
        start = 0
        for name, rows in self.parts.items():
            yield f"{prefix}{name}.weight", self.weight[start : start + rows]
            if self.bias is not None:
                yield f"{prefix}{name}.bias", self.bias[start : start + rows]
            start += rows


class GatedMLP(Layer):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` with ``gate_proj``/``up_proj`` merged: ``x: [T, H] -> [T, H]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, **factory):
        super().__init__()
        parts = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, parts, bias=bias, **factory)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@torch.no_grad()
def narrow_exact_weights(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Store in ``dtype`` every parameter that a submodule lists in its ``narrowable`` attribute and
    that ``dtype`` holds exactly; the others keep theirs. Returns how many were narrowed.

    Exact: the layers widen the weights per call. A narrowed matrix ``[out, in]`` is stored
    transposed (``weight.T`` contiguous), the layout :mod:`tandem.kernels.cpu_linear` reads (blocks
    of its rows too); ``F.linear`` and views that split its axes take it as it is.
    """
    narrowed = 0
    for child in module.modules():
        for name in getattr(child, "narrowable", ()):
            param = getattr(child, name)
            narrow = param.to(dtype)
            if param.dtype != dtype and torch.equal(narrow.to(param.dtype), param):
                narrow = narrow.T.contiguous().T
                setattr(child, name, nn.Parameter(narrow, requires_grad=False))
                narrowed += 1
    return narrowed


def checkpoint_tensors(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """Every parameter of ``module`` as ``(checkpoint key, tensor)``: ``prefix + name``, except that a
    :class:`MergedLinear` yields views of its weight under its parts' keys (next to it, not under it)."""
    for name, param in module.named_parameters(recurse=False):
        yield prefix + name, param
    for name, child in module.named_children():
        if isinstance(child, MergedLinear):
            yield from child.part_tensors(prefix)
        else:
            yield from checkpoint_tensors(child, f"{prefix}{name}.")
