"""The CPU's float32 RMSNorm (`tandem.kernels.cpu_norm`): HF's arithmetic up to the order of the sum of squares.

Each output is ``x * (1 / sqrt(s / D + eps)) * w`` with ``s`` a float32 sum of ``D`` squares: within
``(D + 8) * 2**-24`` of the exact value relatively (the sum's first-order bound, halved by the square root,
plus the few roundings after it), and a row's output does not depend on the other rows of its batch."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels import cpu_norm
from tandem.models.norm import RMSNorm

needs_kernel = pytest.mark.skipif(not cpu_norm.available(), reason="the CPU norm is not built (no C compiler)")


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def test_the_extension_is_built_where_a_compiler_is():
    if shutil.which("cc") is None or platform.system() == "Windows":
        pytest.skip("no C compiler here")
    assert cpu_norm._cpu_norm is not None, "pip install did not build tandem.kernels._cpu_norm"


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(0, 9),
    dim=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3]),
    eps=st.sampled_from([1e-6, 1e-5]),
    columns_around=st.tuples(st.integers(0, 20), st.integers(0, 20)),
    seed=st.integers(0, 2**31 - 1),
)
def test_outputs_are_within_the_rounding_bound_of_the_exact_norm(rows, dim, scale, eps, columns_around, seed):
    """Also for rows that are a column block of a wider matrix (their rows further apart)."""
    g = torch.Generator().manual_seed(seed)
    before, after = columns_around
    x = (torch.randn(rows, before + dim + after, generator=g) * scale)[:, before : before + dim]
    weight = torch.randn(dim, generator=g)
    assert cpu_norm.applies(x, weight)
    out = cpu_norm.rms_norm(x, weight, eps)
    exact = exact_rms_norm(x, weight, eps)
    assert out.dtype == torch.float32 and out.shape == (rows, dim) and out.is_contiguous()
    assert ((out.double() - exact).abs() <= (dim + 8) * 2.0**-24 * exact.abs() + 1e-30).all()


@needs_kernel
@pytest.mark.parametrize("dim", [192, 7, 576])
def test_a_rows_output_does_not_depend_on_its_batch(dim):
    g = torch.Generator().manual_seed(dim)
    x, weight = torch.randn(40, dim, generator=g), torch.randn(dim, generator=g)
    alone = torch.cat([cpu_norm.rms_norm(x[i : i + 1], weight, 1e-5) for i in range(len(x))])
    for rows in (2, 5, 40):
        assert torch.equal(cpu_norm.rms_norm(x[:rows], weight, 1e-5), alone[:rows])
    assert torch.equal(cpu_norm.rms_norm(x.view(8, 5, dim), weight, 1e-5).view(40, dim), alone)  # leading dims


@needs_kernel
def test_the_layer_takes_the_kernel_for_cpu_float32_inference_only(monkeypatch):
    calls = []
    kernel = cpu_norm.rms_norm
    monkeypatch.setattr(cpu_norm, "rms_norm", lambda *args: calls.append(args) or kernel(*args))
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    x = torch.randn(8, 64, generator=g)
    with torch.inference_mode():
        out = norm(x)
        assert len(calls) == 1
        torch.testing.assert_close(out, exact_rms_norm(x, norm.weight, 1e-5).float(), rtol=1e-6, atol=1e-6)
        RMSNorm(64, 1e-5, dtype=torch.bfloat16)(x.bfloat16())  # F.rms_norm
        assert len(calls) == 1
    trained = norm(x.requires_grad_())  # a gradient to record: torch's ops, which have a backward
    trained.sum().backward()
    assert len(calls) == 1 and x.grad is not None and norm.weight.grad is not None
    assert not cpu_norm.applies(torch.randn(3, 64).expand(4, 3, 64), norm.weight.detach())  # overlapping rows
