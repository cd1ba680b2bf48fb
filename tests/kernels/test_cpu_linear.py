"""The CPU small-batch linear (`tandem.kernels.cpu_linear`): float32 rows times bfloat16 weights.

Its sums are float32 multiply-add chains over the inputs in order, so each output is within the
chain's rounding bound ``K * 2**-24 * sum_k |x_k w_k|`` (Higham's gamma_K, first order) of the
exact product, and a row's outputs do not depend on the other rows of its batch. Each C build this CPU
runs (AVX-512, AVX2) is tested, and the builds agree to the bit."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.kernels import cpu_linear
from tandem.models.linear import Linear, linear, narrow_exact_weights
from tandem.models.moe import RoutedExperts

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="the CPU kernel is not built or needs AVX2")
ROWS = max(cpu_linear.BUILD_MAX_ROWS.values())  # the kernel itself takes any rows; `applies` caps them per build


@pytest.fixture
def restored(monkeypatch):
    """The build in use (what `cpu_linear.use` sets) is put back after the test."""
    for name in ("ISA", "MAX_ROWS", "_AVAILABLE", "_BUILD"):
        monkeypatch.setattr(cpu_linear, name, getattr(cpu_linear, name))


@pytest.fixture(params=cpu_linear.BUILDS)
def build(request, restored):
    """Each C build in turn, as `cpu_linear.linear` calls it (skipped where this CPU does not run it)."""
    if request.param not in cpu_linear.RUNNABLE:
        pytest.skip(f"this CPU does not run the {request.param} build")
    cpu_linear.use(request.param)
    return request.param


def transposed_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bfloat16 stored as its transpose, the layout `narrow_exact_weights` leaves."""
    return weight.bfloat16().t().contiguous().t()


def test_the_extension_is_built_where_a_compiler_is():
    if platform.machine() != "x86_64" or shutil.which("cc") is None:
        pytest.skip("no x86-64 C compiler here")
    assert cpu_linear._cpu_linear is not None, "pip install did not build tandem.kernels._cpu_linear"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))  # `build` is set once
@given(
    rows=st.integers(1, ROWS),
    size=st.integers(1, 200),
    outputs=st.integers(1, 600),  # past a one-row block's 256 columns: whole blocks and a tail
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    rows_around=st.tuples(st.integers(0, 40), st.integers(0, 40)),
)
def test_outputs_are_within_the_rounding_bound_of_the_exact_product(
    build, rows, size, outputs, with_bias, seed, rows_around
):
    """Also for a weight that is a block of a wider one's rows (its transpose's rows further apart)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, size, generator=g)
    before, after = rows_around
    weight = transposed_bf16(torch.randn(before + outputs + after, size, generator=g))[before : before + outputs]
    assert cpu_linear.applies(x, weight) == (rows <= cpu_linear.MAX_ROWS)
    bias = torch.randn(outputs, generator=g) if with_bias else None
    out = cpu_linear.linear(x, weight, bias)
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    bound = (
        (size + 1)
        * 2.0**-24
        * (x.double().abs() @ weight.double().abs().t() + (0 if bias is None else bias.double().abs()))
    )
    assert out.dtype == torch.float32 and out.shape == (rows, outputs)
    assert ((out.double() - exact).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("outputs", [320, 1152, 77])
def test_a_rows_outputs_do_not_depend_on_its_batch(build, outputs):
    g = torch.Generator().manual_seed(outputs)
    x = torch.randn(ROWS, 192, generator=g)
    weight = transposed_bf16(torch.randn(outputs, 192, generator=g))
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], weight) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 7, 8, 40, ROWS):  # blocked (AVX-512) 2, 3, 4, 5, 4+3, 4+4, ..., (AVX2) 2, 3, 4, 3+2, ...
        assert torch.equal(cpu_linear.linear(x[:rows], weight), alone[:rows])


@pytest.mark.skipif(len(cpu_linear.RUNNABLE) < 2, reason="this CPU runs one C build at most")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 40])
def test_the_builds_give_the_same_bits(rows, monkeypatch):
    """The same multiply-add chains whatever the registers' width and blocking: AVX2's output is AVX-512's."""
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 200, generator=g), transposed_bf16(torch.randn(333, 200, generator=g))
    bias = torch.randn(333, generator=g)
    outs = []
    for isa in cpu_linear.RUNNABLE:
        monkeypatch.setattr(cpu_linear, "_BUILD", cpu_linear.BUILDS.index(isa))
        outs.append(cpu_linear.linear(x, weight, bias))
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_a_build_this_cpu_does_not_run_is_refused_with_what_it_runs(restored):
    with pytest.raises(ValueError, match="choose auto, off, avx512, avx2"):
        cpu_linear.use("avx3")
    missing = [isa for isa in cpu_linear.BUILDS if isa not in cpu_linear.RUNNABLE]
    if missing:
        with pytest.raises(ValueError, match=f"{missing[0]}' is not available here"):
            cpu_linear.use(missing[0])
    cpu_linear.use("off")
    assert not cpu_linear.available() and cpu_linear.ISA is None and cpu_linear.MAX_ROWS == 0
    cpu_linear.use("auto")
    assert cpu_linear.ISA == (cpu_linear.RUNNABLE[0] if cpu_linear.RUNNABLE else None)


@pytest.mark.parametrize(
    ("setting", "expected"), [("off", "None False"), ("avx3", "$TANDEM_CPU_LINEAR: CPU linear build 'avx3': choose")]
)
def test_the_environment_chooses_the_build_at_import(setting, expected):
    code = "from tandem.kernels import cpu_linear; print(cpu_linear.ISA, cpu_linear.available())"
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "TANDEM_CPU_LINEAR": setting}, capture_output=True, text=True
    )
    assert expected in run.stdout + run.stderr


@needs_kernel
def test_layers_take_the_kernel_for_few_rows_and_f_linear_otherwise(monkeypatch):
    layer = Linear(64, 48)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape).bfloat16().float())
    narrow_exact_weights(layer)
    calls = []
    monkeypatch.setattr(
        cpu_linear, "linear", lambda *args: calls.append(len(args[0])) or F.linear(args[0], args[1].float(), args[2])
    )
    few, many = torch.randn(cpu_linear.MAX_ROWS, 64), torch.randn(cpu_linear.MAX_ROWS + 1, 64)
    layer(few), layer(many), layer(torch.randn(cpu_linear.MAX_ROWS, 128)[:, ::2])  # strided rows: F.linear
    assert calls == [cpu_linear.MAX_ROWS]
    assert not cpu_linear.applies(few, layer.weight.float())  # float32 weights: F.linear
    assert not cpu_linear.applies(few, layer.weight.t().contiguous().t().contiguous())  # [N, K] storage
    assert torch.equal(linear(many, layer.weight, layer.bias), F.linear(many, layer.weight.float(), layer.bias))


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("path", ["dense", "dispatch"])
def test_narrowed_experts_take_the_kernel(path, tokens, monkeypatch):
    """Both ways to run the experts; the dispatch's per-expert gate_up is a block of the stack's rows."""
    torch.manual_seed(0)
    experts = RoutedExperts(32, 16, num_experts=4)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape).bfloat16().float())
    wide = RoutedExperts(32, 16, num_experts=4)
    wide.load_state_dict(experts.state_dict())
    assert narrow_exact_weights(experts) == 2
    calls = []
    kernel = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *args: calls.append(len(args[0])) or kernel(*args))
    x = torch.randn(tokens, 32)
    weights, chosen = torch.rand(tokens, 2), torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])
    with torch.inference_mode():
        out, expected = getattr(experts, path)(x, weights, chosen), getattr(wide, path)(x, weights, chosen)
    if path == "dense":
        assert calls == [tokens, tokens]  # gate_up and down over every expert
    else:
        assert sum(calls) == 2 * 2 * tokens and len(calls) == 2 * chosen.unique().numel()  # per visited expert
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # sums in another order than sgemm


@needs_kernel
def test_mismatched_shapes_are_refused_with_the_shapes():
    x, weight = torch.randn(2, 16), transposed_bf16(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"x \(2, 17\), weight \(8, 16\)"):
        cpu_linear.linear(torch.randn(2, 17), weight)
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.linear(x, weight, torch.randn(7))


@needs_kernel
def test_tensors_the_kernel_would_read_out_of_bounds_are_refused():
    x, weight = torch.randn(2, 16), transposed_bf16(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"weight \(8, 16\) on meta"):  # not a host pointer: it would crash
        linear(x, weight.to("meta"))  # `applies` routes it to the kernel: only the device differs
    with pytest.raises(ValueError, match=r"\(2,\)"):  # every other float of a longer tensor
        cpu_linear.linear(x, weight, torch.randn(16)[::2])
