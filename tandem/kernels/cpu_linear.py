"""``x @ weight.T`` for a few float32 rows and bfloat16 weights on the CPU, in C (``cpu_linear.c``).

Decode, verify and draft steps multiply a few rows by every weight of the model once. For them
the kernel reads each bfloat16 weight once and widens it in registers, where widening to float32
and calling sgemm wrote and re-read it, and ran sgemm's small-M path, slower than a GEMV. Each
output is one multiply-add chain over the inputs in order, the same whatever the number of rows,
so a row's result does not depend on the other rows of its batch.

The C code has two builds of one blocking, AVX-512 and AVX2 + FMA (most laptops and older servers), whose sums are
the same chains, so they give the same bits; :data:`ISA` is the one in use: the fastest this CPU runs, or the one
``$TANDEM_CPU_LINEAR`` names (``avx512``, ``avx2``; ``off``: the torch path), as :func:`use` sets it.

Under ``torch.compile`` the kernel is the custom op ``tandem::cpu_linear`` (a fake implementation
gives its output's shape), which inductor calls as an opaque kernel; eager calls go to the C
function directly, which spares each of a step's linears the op's dispatch.

The extension is built at install when a C compiler is there (``pyproject.toml``); without it,
or on a CPU with neither AVX-512 nor AVX2, :func:`available` is False and the layers use ``F.linear``.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    from tandem.kernels import _cpu_linear
except ImportError:  # built without a C compiler
    _cpu_linear = None

BUILDS = ("avx512", "avx2")  # the C code's builds, fastest first, by the index its `linear` takes
# The most rows each build takes: up to these it beats widening + sgemm (batch 8 verifying k = 4 is 40 rows). AVX2's
# blocks hold at most four rows in its 16 registers, so more rows re-read each weight more often than AVX-512's six.
BUILD_MAX_ROWS = {"avx512": 64, "avx2": 16}
RUNNABLE: tuple[str, ...] = () if _cpu_linear is None else tuple(_cpu_linear.isas())  # those this CPU runs
ISA: str | None = None  # the build `linear` calls (None: the kernel is off)
MAX_ROWS = 0  # the most rows `linear` takes: its build's BUILD_MAX_ROWS
_AVAILABLE = False
_BUILD = -1


def use(isa: str) -> None:
    """Make :func:`linear` call build ``isa`` ("avx512", "avx2"), or the fastest this CPU runs ("auto"), or none
    ("off": the layers use ``F.linear``). ValueError naming what this CPU runs when it does not run ``isa``."""
    global ISA, MAX_ROWS, _AVAILABLE, _BUILD
    if isa not in ("auto", "off", *BUILDS):
        raise ValueError(f"CPU linear build {isa!r}: choose auto, off, {', '.join(BUILDS)}")
    if isa not in ("auto", "off") and isa not in RUNNABLE:
        built = "this CPU runs " + (", ".join(RUNNABLE) or "none") if _cpu_linear is not None else "it is not built"
        raise ValueError(f"CPU linear build {isa!r} is not available here: {built}")
    ISA = None if isa == "off" else (RUNNABLE[0] if RUNNABLE else None) if isa == "auto" else isa
    _AVAILABLE, _BUILD = ISA is not None, -1 if ISA is None else BUILDS.index(ISA)
    MAX_ROWS = BUILD_MAX_ROWS.get(ISA, 0)


try:
    use(os.environ.get("TANDEM_CPU_LINEAR", "auto"))
except ValueError as error:
    raise ValueError(f"$TANDEM_CPU_LINEAR: {error}") from None


def available() -> bool:
    """True when :func:`linear` runs a C build here (the extension is built, this CPU runs AVX-512 or AVX2 + FMA,
    and ``$TANDEM_CPU_LINEAR`` is not ``off``)."""
    return _AVAILABLE


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`linear` takes ``x [M, K]`` and ``weight [N, K]``: a CPU float32 ``x`` of at most
    :data:`MAX_ROWS` contiguous rows, and a bfloat16 weight stored transposed (``weight.T``'s rows
    contiguous, as :func:`tandem.models.linear.narrow_exact_weights` leaves it, or a block of such a
    weight's rows)."""
    if not (  # called for every linear of a step: cheapest checks first, strides read directly
        _AVAILABLE
        and weight.dtype == torch.bfloat16
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.is_cpu
        and x.is_contiguous()
    ):
        return False
    column_stride, row_stride = weight.stride()  # row_stride: between the transpose's rows, unread for one input
    # One output reads no second column: its column stride is free (torch leaves any there for size-1 dims).
    return (column_stride == 1 or weight.shape[0] == 1) and (row_stride >= weight.shape[0] or weight.shape[1] == 1)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [M, K] float32 @ weight [N, K] bfloat16 .T (+ bias [N] float32)`` -> ``[M, N] float32``.

    Only for inputs that :func:`applies` to; the caller checks. This checks what would otherwise have
    the C code read outside the tensors: the shapes, the weight's and bias's device, the bias's layout.
    Traced by ``torch.compile``, it is the custom op ``torch.ops.tandem.cpu_linear``.
    """
    if torch.compiler.is_compiling():
        return cpu_linear_op(x, weight, bias)
    (rows, size), outputs = x.shape, weight.shape[0]
    bias_fits = bias is None or (
        bias.shape == (outputs,) and bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()
    )
    if weight.shape[1] != size or not weight.is_cpu or not bias_fits:
        raise ValueError(
            f"linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} on {weight.device} and bias "
            f"{None if bias is None else (tuple(bias.shape), bias.dtype, str(bias.device), bias.stride())} "
            f"do not fit (CPU tensors, a contiguous float32 bias)"
        )
    out = x.new_empty(rows, outputs)
    _cpu_linear.linear(
        x.data_ptr(),
        weight.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        size,
        outputs,
        weight.stride(1),
        _BUILD,
    )
    return out


# :func:`linear` as an operator, what a compiled graph calls (``x`` contiguous, as :func:`applies` asks). Defined
# through a library fragment with a CPU kernel rather than ``torch.library.custom_op``: a compiled step calls it
# for every matmul, and custom_op runs its own Python wrapper around each call besides the dispatcher.
_library = torch.library.Library("tandem", "FRAGMENT")
_library.define("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.impl("cpu_linear", linear, "CPU")
cpu_linear_op = torch.ops.tandem.cpu_linear.default


@torch.library.register_fake("tandem::cpu_linear")
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
