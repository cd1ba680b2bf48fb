"""The kernels' random numbers: the torch path's uniforms bit for bit, and exponentials that stay
accurate for the small values an exponential race turns on."""

import numpy as np
import torch
import triton
import triton.language as tl
from scipy import stats

from tandem.core.rng import STREAM_ACCEPT, STREAM_EMIT
from tandem.core.rng import uniform as torch_uniform
from tandem.kernels.rng import exponential, stream_state, uniform

from .cases import DEVICE

COUNTERS = 256


@triton.jit
def _draw_kernel(
    seed_ptr, uniform_ptr, exponential_ptr, STREAM: tl.constexpr, COUNT: tl.constexpr, FAST_LOG: tl.constexpr
):
    row = tl.program_id(0)
    state = stream_state(tl.load(seed_ptr + row), STREAM)
    counters = tl.arange(0, COUNT)
    tl.store(uniform_ptr + row * COUNT + counters, uniform(state, counters))
    tl.store(exponential_ptr + row * COUNT + counters, exponential(state, counters, FAST_LOG))


def _draw(seeds: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, COUNTERS] uniforms and exponentials of counters 0..COUNTERS-1 on the CPU."""
    seeds = seeds.to(DEVICE)
    u = torch.empty(len(seeds), COUNTERS, device=DEVICE)
    e = torch.empty_like(u)
    _draw_kernel[(len(seeds),)](seeds, u, e, STREAM=stream, COUNT=COUNTERS, FAST_LOG=DEVICE == "cuda")  # as the race
    return u.cpu(), e.cpu()


SEEDS = torch.tensor([0, 1, -1, 7919, 2**62 + 12345, -(2**63), 2**63 - 1, 123456789012345])


def test_uniforms_equal_the_torch_paths_bit_for_bit():
    for stream in (STREAM_ACCEPT, STREAM_EMIT):
        u, _ = _draw(SEEDS, stream)
        assert torch.equal(u, torch_uniform(SEEDS, stream, torch.arange(COUNTERS)))


def test_exponentials_are_accurate_for_small_values_and_never_zero():
    _, e = _draw(SEEDS, STREAM_EMIT)
    # The same 24 bits the kernel used, then E = -log1p(-w) in float64 at the bin midpoint.
    bits = (torch_uniform(SEEDS, STREAM_EMIT, torch.arange(COUNTERS)).double() * 2**24 - 1).numpy()
    exact = -np.log1p(-(bits + 0.5) / 2**24)
    np.testing.assert_allclose(e.double().numpy(), exact, rtol=2e-6)
    assert (e > 0).all() and torch.isfinite(e).all()


def test_exponentials_follow_exp1():
    _, e = _draw(torch.arange(40) * 31 + 5, STREAM_EMIT)
    p_value = stats.kstest(e.double().numpy().ravel(), "expon").pvalue
    assert p_value > 1e-4, f"KS p = {p_value:.2e}"
