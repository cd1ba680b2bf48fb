"""Launch grids past 65,535 rows: rows go on grid axis 0 (up to 2**31 - 1 programs on CUDA), never on
axes 1 and 2, which CUDA caps at 65,535 ("invalid argument" at launch)."""

import pytest
import torch

from tandem.core.bitmask import pack_bitmask
from tandem.decoding import SamplingTensors, accept
from tandem.kernels import acceptance as kernel_module
from tandem.kernels import bitmask as bitmask_module

from .cases import DEVICE, accept_triton, block_size

CUDA_GRID_LIMITS = (2**31 - 1, 65_535, 65_535)
ROWS = 65_536
ACCEPT_KERNELS = ("_chunk_max_kernel", "_chunk_stats_kernel", "_walk_kernel", "_race_kernel", "_race_finish_kernel")


class LaunchRecorder:
    """Stands in for a Triton kernel: `kernel[grid](...)` records the grid and launches nothing."""

    def __init__(self, name: str, launches: list[tuple[str, tuple[int, ...]]]) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid: tuple[int, ...]):
        self.launches.append((self.name, tuple(grid)))
        return lambda *args, **kwargs: None


def assert_rows_on_axis_0(launches: list[tuple[str, tuple[int, ...]]], rows: int) -> None:
    for name, grid in launches:
        assert grid[0] == rows, f"{name}: grid {grid} does not put the {rows} rows on axis 0"
        assert all(size <= limit for size, limit in zip(grid, CUDA_GRID_LIMITS)), f"{name}: grid {grid}"


def test_every_acceptance_launch_puts_the_rows_on_axis_0(monkeypatch):
    launches: list[tuple[str, tuple[int, ...]]] = []
    for name in ACCEPT_KERNELS:
        monkeypatch.setattr(kernel_module, name, LaunchRecorder(name, launches))
    k, vocab_size = 3, 40
    logits = torch.zeros(ROWS, k + 1, vocab_size)
    sampling = SamplingTensors.full(ROWS, temperature=0.7, min_p=0.05, seed=torch.arange(ROWS))
    kernel_module.accept_triton(
        logits,
        torch.zeros(ROWS, k, dtype=torch.int64),
        temperature=sampling.temperature,
        min_p=sampling.min_p,
        seed=sampling.seed,
        in_thinking=torch.ones(ROWS, k + 1, dtype=torch.bool),
        relaxed_top_k=2,
    )
    assert sorted({name for name, _ in launches}) == sorted(ACCEPT_KERNELS)  # min-p + stochastic: every pass
    assert_rows_on_axis_0(launches, ROWS)


def test_the_bitmask_launch_puts_the_rows_on_axis_0(monkeypatch):
    launches: list[tuple[str, tuple[int, ...]]] = []
    monkeypatch.setattr(bitmask_module, "_apply_bitmask_kernel", LaunchRecorder("_apply_bitmask_kernel", launches))
    bitmask_module.apply_bitmask_triton(torch.zeros(ROWS, 40), torch.zeros(ROWS, 2, dtype=torch.int32))
    assert [name for name, _ in launches] == ["_apply_bitmask_kernel"]
    assert_rows_on_axis_0(launches, ROWS)


def test_a_many_row_launch_equals_the_torch_path():
    """The reordered grid computes the right rows: the interpreter runs a few milliseconds per program, so
    the CPU run keeps 65 rows over several chunks per pass (the 65,536-row run is the GPU test below)."""
    rows, k, vocab_size = 65, 2, 20
    generator = torch.Generator().manual_seed(7)
    logits = torch.randint(-3, 3, (rows, k + 1, vocab_size), generator=generator).float()
    allowed = torch.rand(rows, k + 1, vocab_size, generator=generator) < 0.6
    drafts = torch.where(
        torch.rand(rows, k, generator=generator) < 0.7,
        logits[:, :k].masked_fill(~allowed[:, :k], float("-inf")).argmax(-1),
        torch.randint(vocab_size, (rows, k), generator=generator),
    )
    bitmask = pack_bitmask(allowed)
    expected = accept(logits, drafts, bitmask=bitmask, backend="torch")
    with block_size(8):  # 3 chunks per position
        got = accept_triton(logits.to(DEVICE), drafts.to(DEVICE), bitmask=bitmask.to(DEVICE))
    assert torch.equal(got.tokens.cpu(), expected.tokens)
    assert torch.equal(got.num_accepted.cpu(), expected.num_accepted)
    assert torch.equal(got.dead_end.cpu(), expected.dead_end)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_65536_rows_accept_on_cuda():
    rows, k, vocab_size = ROWS + 7, 2, 64
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, k + 1, vocab_size, generator=generator)
    drafts = torch.where(
        torch.rand(rows, k, generator=generator) < 0.7,
        logits[:, :k].argmax(-1),
        torch.randint(vocab_size, (rows, k), generator=generator),
    )
    expected = accept(logits, drafts, backend="torch")
    got = accept_triton(logits.cuda(), drafts.cuda())
    assert torch.equal(got.tokens.cpu(), expected.tokens)
    assert torch.equal(got.num_accepted.cpu(), expected.num_accepted)
    sampling = SamplingTensors.full(rows, temperature=0.8, seed=torch.arange(rows))
    expected = accept(logits, drafts, sampling=sampling, backend="torch")
    got = accept_triton(logits.cuda(), drafts.cuda(), sampling=sampling.to("cuda"))
    assert torch.equal(got.num_accepted.cpu(), expected.num_accepted)  # the same uniforms decide acceptance
