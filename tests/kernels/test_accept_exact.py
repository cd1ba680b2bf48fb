"""Greedy and relaxed acceptance in the kernel: exactly the torch path's results, ties included."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.bitmask import pack_bitmask
from tandem.decoding import AcceptanceResult, RelaxedAcceptance, SamplingTensors, accept

from .cases import DEVICE, accept_triton, block_size, tie_heavy_batch


def _both(logits, drafts, allowed, block, **kwargs):
    """(torch result, kernel result on DEVICE, moved back to the CPU) for the same inputs."""
    bitmask = None if allowed is None else pack_bitmask(allowed)
    expected = accept(logits, drafts, bitmask=bitmask, **kwargs)
    on_device = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    if isinstance(kwargs.get("sampling"), SamplingTensors):
        on_device["sampling"] = kwargs["sampling"].to(DEVICE)
    with block_size(block):
        got = accept_triton(
            logits.to(DEVICE), drafts.to(DEVICE), bitmask=None if bitmask is None else bitmask.to(DEVICE), **on_device
        )
    return expected, AcceptanceResult(*(getattr(got, f).cpu() for f in ("num_accepted", "tokens", "dead_end")))


def _assert_same(expected, got):
    assert torch.equal(got.num_accepted, expected.num_accepted)
    assert torch.equal(got.tokens, expected.tokens)
    assert torch.equal(got.dead_end, expected.dead_end)


@given(tie_heavy_batch())
@settings(max_examples=60)
def test_greedy_equals_the_torch_path(case):
    _assert_same(*_both(*case))


@given(tie_heavy_batch(), st.integers(1, 12), st.sampled_from([0.0, 0.1, 0.6, 1.0]))
@settings(max_examples=60)
def test_relaxed_greedy_rows_equal_the_torch_path(case, top_k, delta):
    logits, drafts, allowed, block = case
    batch, k = drafts.shape
    in_thinking = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(k)) < 0.7
    _assert_same(
        *_both(
            logits, drafts, allowed, block, in_thinking=in_thinking, relaxed=RelaxedAcceptance(top_k=top_k, delta=delta)
        )
    )


@given(tie_heavy_batch())
@settings(max_examples=30)
def test_greedy_rows_of_a_stochastic_batch_equal_the_torch_path(case):
    logits, drafts, allowed, block = case
    batch = logits.shape[0]
    # Greedy rows with filters set (moot at temperature 0), plus one stochastic row that
    # makes the kernel compile its stochastic path.
    sampling = SamplingTensors(
        torch.cat([torch.zeros(batch), torch.ones(1)]),
        torch.full((batch + 1,), 3),
        torch.full((batch + 1,), 0.5),
        torch.full((batch + 1,), 0.1),
        torch.arange(batch + 1),
    )
    with_row = lambda t: None if t is None else torch.cat([t, t[:1]])  # noqa: E731
    expected, got = _both(with_row(logits), with_row(drafts), with_row(allowed), block, sampling=sampling)
    _assert_same(
        AcceptanceResult(expected.num_accepted[:batch], expected.tokens[:batch], expected.dead_end[:batch]),
        AcceptanceResult(got.num_accepted[:batch], got.tokens[:batch], got.dead_end[:batch]),
    )


def test_relaxed_rule_on_continuous_logits_over_many_blocks():
    # Real-valued probabilities (no grid ties), 4 blocks per pass: the rank and the delta test.
    generator = torch.Generator().manual_seed(3)
    batch, k, vocab_size = 8, 4, 200
    logits = torch.randn(batch, k + 1, vocab_size, generator=generator)
    ranked = logits[:, :k].argsort(dim=-1, descending=True)
    drafts = ranked.gather(-1, torch.randint(4, (batch, k, 1), generator=generator)).squeeze(-1)  # top-4 tokens
    in_thinking = torch.rand(batch, k + 1, generator=generator) < 0.8
    greedy = accept(logits, drafts).num_accepted
    for delta in (0.005, 0.02):
        expected, got = _both(
            logits, drafts, None, 64, in_thinking=in_thinking, relaxed=RelaxedAcceptance(top_k=3, delta=delta)
        )
        _assert_same(expected, got)
        assert (expected.num_accepted > greedy).any()  # the relaxed rule decided something here


def test_k_zero_is_plain_greedy_sampling_and_v_one_always_accepts():
    logits = torch.randn(3, 1, 7)
    _assert_same(*_both(logits, torch.empty(3, 0, dtype=torch.int64), None, 4096))
    _assert_same(*_both(torch.randn(2, 3, 1), torch.zeros(2, 2, dtype=torch.int64), None, 4096))


def test_bad_input_gets_the_torch_paths_error():
    logits = torch.zeros(2, 3, 10, device=DEVICE)
    with pytest.raises(ValueError, match=r"draft_tokens must have shape \[2, 2\], got \[2, 3\]"):
        accept_triton(logits, torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))
