"""Matmuls with weights: :func:`linear`, :class:`Linear`, :class:`MergedLinear`, :class:`RowParallelLinear`, and
weights stored narrower.

Merged projections: :class:`MergedLinear` keeps several published projections that read the same
input (Llama's ``q_proj``/``k_proj``/``v_proj``, SwiGLU's ``gate_proj``/``up_proj``, MLA's
``q_a_proj``/``kv_a_proj_with_mqa``) as one weight, so one matmul serves them all (vLLM's merged
column-parallel layers). On small models most of a decode step is per-op overhead, so every op
saved counts. Checkpoints still name each part
(:func:`~tandem.models.loading.checkpoint_tensors`).

Tensor parallel (Megatron's layout, as vLLM's): given a parallel :class:`~tandem.models.parallel.Shard`, a
:class:`MergedLinear` is column-parallel (each rank the rows of its piece of every part: its heads, its MLP
columns) and a :class:`RowParallelLinear` reads those pieces (its input columns) and sums the ranks' products,
so a column-parallel / row-parallel pair costs one all-reduce. Each parameter names its piece of the stored
tensor (``checkpoint_parts``, :class:`~tandem.models.loading.Part`), the only bytes its rank reads.

Weights stored narrower (the CPU fast path): :func:`narrow_exact_weights` keeps in bfloat16 every
matmul weight that bfloat16 holds exactly (all of a bfloat16 checkpoint's, in a float32 model), and
:func:`linear` widens them per call. A module lists the parameters it reads through :func:`linear` in its
``narrowable`` attribute (a tied embedding too, whose lookups widen their rows); others (MLA's ``kv_b_proj``,
read by ``bmm``) stay wide. Reason: a decode step reads every weight once, and on the CPU a small model waits on
the caches to deliver them; half the bytes fit the last-level cache. For a few float32 rows,
:func:`linear` calls the C kernel of :mod:`tandem.kernels.cpu_linear`, which widens the weight in
registers instead of into a copy; narrowed matrices are stored transposed, the layout it reads. Without the
kernel a matrix past :data:`WIDEN_MAX_ELEMENTS` stays wide: its per-call widened copy would cost more than the
bytes it saves.

Invariant: the float32 model's very weights, so its results up to the order in which sums are
taken (sgemm's order depends on the weight's layout and the number of rows, the C kernel's is its
own).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.kernels import cpu_linear
from tandem.models.layers import Layer
from tandem.models.loading import Part
from tandem.models.parallel import SINGLE, Shard

# Without the C kernel `linear` widens a narrowed weight into a fresh copy at every call. Past 32 MB of float32 (glibc
# maps each such allocation anew) the copy costs more than the halved bytes save: README, "fast paths".
WIDEN_MAX_ELEMENTS = 8 * 2**20


def widened(weight: Tensor, like: Tensor) -> Tensor:
    """``weight`` in ``like``'s dtype (a copy only when it is stored narrower: :func:`narrow_exact_weights`)."""
    return weight if weight.dtype == like.dtype else weight.to(like.dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` for a weight that may be stored narrower: ``x [T, in] @ weight [out, in].T -> [T, out]``.

    The one dispatch of a matmul with a weight: a few float32 rows on the CPU times a narrowed
    weight take the C kernel (:func:`tandem.kernels.cpu_linear.applies`), anything else
    ``F.linear`` on the widened weight.
    """
    if cpu_linear.applies(x, weight):
        return cpu_linear.linear(x, weight, bias)
    return F.linear(x, widened(weight, x), bias)


class Linear(Layer, nn.Linear):
    """``nn.Linear`` whose weight may be stored narrower than it computes: ``x: [T, in] -> [T, out]``.

    ``narrowable=False`` for a weight that other ops than :func:`linear` read (it is never narrowed).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, narrowable: bool = True, **factory):
        super().__init__(in_features, out_features, bias, **factory)
        self.narrowable = ("weight",) if narrowable else ()  # the parameters `narrow_exact_weights` may narrow

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Layer):
    """Linears over one input stored as a single ``[sum(out), in]`` weight: ``x: [T, in] -> [T, sum(out)]``,
    the parts' outputs side by side in order (``.split(self.sizes, -1)`` separates them).

    ``parts`` maps each checkpoint name (``"q_proj"``) to its output size; the checkpoint keys are
    ``{parent prefix}{name}.weight`` (and ``.bias``), as if each part were its own ``nn.Linear``.
    Column-parallel with a parallel ``shard``: each part keeps this rank's ``1 / shard.size`` of its outputs
    (``sizes`` are the local ones; ValueError naming the part where the size does not divide its outputs).
    """

    narrowable = ("weight",)

    def __init__(
        self, in_features: int, parts: dict[str, int], *, bias: bool = False, shard: Shard = SINGLE, **factory
    ):
        super().__init__()
        self.in_features, self.shard = in_features, shard
        self.parts = {name: shard.part(rows, f"{name} outputs")[1] for name, rows in parts.items()}
        self.sizes = list(self.parts.values())
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features, **factory))
        self.bias = nn.Parameter(torch.empty(sum(self.sizes), **factory)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def part_tensors(self, prefix: str) -> Iterator[tuple[str, Tensor, Part | None]]:
        """``(checkpoint key, view of the merged parameter, the piece of the stored tensor it holds)`` for each
        part's weight (and bias); the piece is None on one device (the whole tensor)."""
        piece = Part(0, self.shard.rank, self.shard.size) if self.shard.parallel else None
        start = 0
        for name, rows in self.parts.items():
            yield f"{prefix}{name}.weight", self.weight[start : start + rows], piece
            if self.bias is not None:
                yield f"{prefix}{name}.bias", self.bias[start : start + rows], piece
            start += rows


class RowParallelLinear(Linear):
    """A linear whose input features are split over ``shard``'s ranks: ``x: [T, in / size]`` (this rank's columns,
    a column-parallel layer's output) ``-> [T, out]``, the sum of every rank's product, plus the bias once.

    The weight is this rank's ``[out, in / size]`` columns (ValueError where the size does not divide
    ``in_features``); the bias is whole, added after the all-reduce. On one device, a :class:`Linear`.
    ``reduce=False`` (no bias) returns this rank's partial sum instead, for a caller that adds other partial sums
    before one all-reduce of them all.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        shard: Shard = SINGLE,
        reduce: bool = True,
        **factory,
    ):
        if bias and not reduce:
            raise ValueError("RowParallelLinear: a partial sum (reduce=False) takes no bias")
        super().__init__(shard.part(in_features, "input features")[1], out_features, bias, **factory)
        self.shard, self.reduce = shard, reduce
        self.checkpoint_parts = {"weight": Part(1, shard.rank, shard.size)} if shard.parallel else {}

    def forward(self, x: Tensor) -> Tensor:
        if not self.shard.parallel:
            return linear(x, self.weight, self.bias)
        out = linear(x, self.weight)
        if not self.reduce:
            return out
        out = self.shard.all_reduce(out)
        return out if self.bias is None else out + self.bias


@torch.no_grad()
def narrow_exact_weights(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Store in ``dtype`` every parameter that a submodule lists in its ``narrowable`` attribute and
    that ``dtype`` holds exactly (without the C kernel, of at most :data:`WIDEN_MAX_ELEMENTS` elements); the
    others keep theirs. Returns how many were narrowed.

    Exact: :func:`linear` widens the weights per call. A narrowed matrix ``[out, in]`` is stored
    transposed (``weight.T`` contiguous), the layout :mod:`tandem.kernels.cpu_linear` reads (blocks
    of its rows too); ``F.linear`` and views that split its axes take it as it is.
    """
    narrowed = 0
    limit = None if cpu_linear.available() else WIDEN_MAX_ELEMENTS
    for child in module.modules():
        for name in getattr(child, "narrowable", ()):
            param = getattr(child, name)
            if limit is not None and param.numel() > limit:
                continue
            narrow = param.to(dtype)
            if param.dtype != dtype and torch.equal(narrow.to(param.dtype), param):
                narrow = narrow.T.contiguous().T
                setattr(child, name, nn.Parameter(narrow, requires_grad=False))
                narrowed += 1
    return narrowed
