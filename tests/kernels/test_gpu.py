"""The compiled kernels on a real GPU at the vocabulary sizes that matter (skipped without CUDA)."""

import pytest
import torch

from tandem.core.bitmask import pack_bitmask, unpack_bitmask
from tandem.decoding import RelaxedAcceptance, SamplingTensors, accept
from tandem.kernels import apply_bitmask_triton
from tests.decoding.reference import assert_distributed_as, reference_probs

from .cases import accept_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _case(batch: int, k: int, vocab_size: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(vocab_size + batch)
    logits = (torch.randn(batch, k + 1, vocab_size, generator=generator) * 3).to(dtype)
    allowed = torch.rand(batch, k + 1, vocab_size, generator=generator) < 0.3
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    drafts = torch.where(
        torch.rand(batch, k, generator=generator) < 0.8,
        masked[:, :k].argmax(-1),
        torch.randint(vocab_size, (batch, k), generator=generator),
    )
    return logits.cuda(), drafts.cuda(), pack_bitmask(allowed).cuda()


@pytest.mark.parametrize("vocab_size", [128_256, 129_280])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_relaxed_and_stochastic_decisions_equal_the_torch_path(vocab_size, dtype):
    logits, drafts, bitmask = _case(64, 4, vocab_size, dtype)
    thinking = torch.rand(64, 5, device="cuda") < 0.5
    for kwargs in ({}, {"in_thinking": thinking, "relaxed": RelaxedAcceptance()}):
        expected = accept(logits, drafts, bitmask=bitmask, backend="torch", **kwargs)
        got = accept_triton(logits, drafts, bitmask=bitmask, **kwargs)
        assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.dead_end, expected.dead_end)
    sampling = SamplingTensors.full(64, temperature=0.8, min_p=0.01, seed=torch.arange(64)).to("cuda")
    expected = accept(logits, drafts, bitmask=bitmask, sampling=sampling, backend="torch")
    got = accept_triton(logits, drafts, bitmask=bitmask, sampling=sampling)
    assert torch.equal(got.num_accepted, expected.num_accepted)


def test_bonus_tokens_follow_the_target_at_full_vocabulary():
    rows, vocab_size = 20_000, 128_256
    logits = torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    drafts = torch.full((rows, 1), int(logits[0].argmax()))
    logits[0, drafts[0, 0]] = 40.0  # always accepted: every row emits a bonus sample of p_1
    sampling = SamplingTensors.full(rows, seed=torch.arange(rows)).to("cuda")
    result = accept_triton(logits.cuda().expand(rows, -1, -1), drafts.cuda(), sampling=sampling)
    assert (result.num_accepted == 1).all()
    assert_distributed_as(result.tokens[:, 1].cpu(), reference_probs(logits[1]), "bonus token")


def test_apply_bitmask_at_full_vocabulary():
    logits, _, bitmask = _case(8, 4, 129_280, torch.bfloat16)
    expected = logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))
    apply_bitmask_triton(logits, bitmask)
    assert torch.equal(logits, expected)
