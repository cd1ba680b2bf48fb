"""Per-row seeds and mixed batches: a row's result depends only on its own inputs and seed."""

import numpy as np
import torch

from tandem.decoding import RelaxedAcceptance, SamplingTensors, accept

from .reference import assert_rate, reference_probs
from .strategies import mixed_rows

VOCAB, K = 50, 4


def _accept(rows, order):
    logits, drafts, q, bitmask, sampling, thinking = rows
    picked = sampling.select(order)
    return accept(
        logits[order],
        drafts[order],
        draft_probs=q[order],
        sampling=picked,
        bitmask=bitmask[order],
        in_thinking=thinking[order],
        relaxed=RelaxedAcceptance(),
    )


def test_a_row_gets_the_same_tokens_whatever_else_is_in_the_batch_and_in_any_order():
    rows = mixed_rows(64, seed=1, k=K, vocab_size=VOCAB)
    alone = torch.stack([_accept(rows, torch.tensor([b])).tokens[0] for b in range(64)])
    full = _accept(rows, torch.arange(64)).tokens
    assert torch.equal(full, alone)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(_accept(rows, order).tokens, alone[order])
    subset = torch.tensor([5, 63, 0, 17])
    assert torch.equal(_accept(rows, subset).tokens, alone[subset])


def test_same_seed_same_tokens_different_seeds_independent_draws():
    rows, vocab_size = 20_000, 16
    logits = torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(4))
    drafts = torch.zeros(rows, 1, dtype=torch.int64)
    target = logits.expand(rows, -1, -1)
    seeds = torch.arange(rows)
    first = accept(target, drafts, sampling=SamplingTensors.full(rows, seed=seeds)).tokens[:, 0]
    again = accept(target, drafts, sampling=SamplingTensors.full(rows, seed=seeds)).tokens[:, 0]
    other = accept(target, drafts, sampling=SamplingTensors.full(rows, seed=seeds + rows)).tokens[:, 0]
    assert torch.equal(first, again)
    # Independent draws from the same distribution p coincide with probability sum_x p(x)^2.
    p = reference_probs(logits[0])
    assert_rate(int((first == other).sum()), rows, float(np.sum(p**2)), "coincidence of independent draws")
