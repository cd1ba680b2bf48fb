"""The shared layers' arithmetic: RMSNorm against its float32 definition."""

import pytest
import torch

from tandem.kernels import cpu_norm
from tandem.models.norm import RMSNorm

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
@torch.inference_mode()
def test_a_narrow_rms_norm_rounds_its_float32_result_once(dtype):
    """``weight * x / rms(x)`` computed in float32 and rounded once: within 1.5 unit roundoffs of the
    exact value (0.99 on these inputs). HF's upcast-normalise-downcast-scale rounds twice: 1.84 here."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(192, 1e-6, dtype=dtype)
    norm.weight.copy_(torch.randn(192, generator=gen) * 0.5 + 1)
    x = (torch.randn(256, 192, generator=gen) * 3).to(dtype)
    xf = x.double()
    exact = norm.weight.double() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    out = norm(x)
    assert out.dtype == dtype
    assert ((out.double() - exact).abs() / exact.abs()).max() <= 1.5 * UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@torch.inference_mode()
def test_a_float32_rms_norm_is_hf_arithmetic(kernel, monkeypatch):
    """Op for op with torch's ops; the CPU kernel (`tandem.kernels.cpu_norm`) sums the squares in its own order."""
    if kernel and not cpu_norm.available():
        pytest.skip("the CPU norm is not built")
    monkeypatch.setattr(cpu_norm, "_AVAILABLE", kernel)
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    norm.weight.copy_(torch.randn(64, generator=gen))
    x = torch.randn(8, 64, generator=gen)
    hf = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    if kernel:
        torch.testing.assert_close(norm(x), hf, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(norm(x), hf)
