"""`accept(backend=...)` reaches the kernels; `auto` keeps CPU tensors on the torch path."""

from unittest.mock import patch

import torch

import tandem.kernels
from tandem.decoding import accept

from .cases import DEVICE


def test_backend_triton_runs_the_kernels_with_the_same_greedy_result():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 3, 40, generator=generator)
    drafts = logits[:, :2].argmax(-1)
    drafts[1, 0] = (drafts[1, 0] + 1) % 40
    with patch("tandem.kernels.accept_triton", wraps=tandem.kernels.accept_triton) as kernel:
        fused = accept(logits.to(DEVICE), drafts.to(DEVICE), backend="triton")
    assert kernel.call_count == 1
    reference = accept(logits, drafts, backend="torch")
    assert torch.equal(fused.tokens.cpu(), reference.tokens) and torch.equal(
        fused.num_accepted.cpu(), reference.num_accepted
    )


def test_auto_uses_torch_for_cpu_tensors():
    with patch("tandem.kernels.accept_triton") as kernel:
        accept(torch.zeros(1, 2, 8), torch.zeros(1, 1, dtype=torch.int64))
    assert kernel.call_count == 0
