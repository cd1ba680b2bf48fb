"""The kernel's lossless rule: the same distributions as the torch path, per-row seeds.

Each scenario builds ~1,000 rows that share one step's distributions, one draw per row, and checks
them with the acceptance tests' own statistical helpers (tests/decoding/reference.py: each check
falsely fails a correct implementation with probability ALPHA = 1e-4; the 7 checks here bound
this file's false-alarm rate by 1e-3, and the fixed seeds make every run repeat). 1,000-1,200 draws
over 10 tokens detect a wrong temperature or a skewed residual, and an acceptance rate off by more
than ~0.06.

The CPU interpreter runs a kernel row in about a tenth of a second, so it runs every 12th row only
(`KERNEL_ROWS`), and the statistics are drawn from the kernel's rule written out in torch (`_race`):
the kernel must accept exactly the drafts the torch path accepts (both test draft j with the same
uniform, STREAM_ACCEPT counter j) and emit, token for token, the race winner `_race` computes from the
same seeds. The draws of the rows it runs are then the kernel's own, and the others the same function
of their seeds.
"""

import numpy as np
import torch

from tandem.core.bitmask import pack_bitmask
from tandem.core.rng import STREAM_EMIT, uniform
from tandem.decoding import AcceptanceResult, RelaxedAcceptance, SamplingTensors, accept
from tests.decoding.reference import assert_distributed_as, assert_rate, reference_probs
from tests.decoding.strategies import mixed_rows, random_allowed

from .cases import DEVICE, accept_triton, block_size

ROWS = 1200
VOCAB = 10
KERNEL_ROWS = 12  # the interpreter runs one row in this many (module docstring)


def _race(logits, drafts, stop, seeds, *, allowed=None, q=None, temperature=1.0, min_p=0.0) -> torch.Tensor:
    """The token the kernel emits at each row's stop position (tandem/kernels/acceptance.py, `_race_kernel`).

    logits [k+1, V], allowed [k+1, V] and q [k, V] are every row's; drafts [rows, k], stop [rows] (the accepted
    drafts), seeds [rows]. The winner is the argmax of w_i / E_i over the support (the allowed tokens min-p
    keeps), E_i ~ Exp(1) from the uniform (seed, STREAM_EMIT, i): w = p - q where the draft at the stop was a
    real token and was rejected (one-hot q: p without that token), else p; p where w is nowhere positive. The
    keys are float64 here and float32 in the kernel: their argmaxes differ only where two keys lie within float32
    rounding (on CUDA, the fast log's error: under 3e-6 relative) of each other."""
    k, vocab = drafts.shape[1], logits.shape[-1]
    x = logits.double()[stop]  # [rows, V]
    if allowed is not None:
        x = x.masked_fill(~allowed[stop], float("-inf"))
    p = torch.softmax(x / temperature, dim=-1)
    support = (p > 0) & (p >= min_p * p.max(dim=-1, keepdim=True).values)
    p = torch.where(support, p, 0.0)
    p = p / p.sum(dim=-1, keepdim=True)
    bits = uniform(seeds, STREAM_EMIT, torch.arange(vocab)).double() * 2**24 - 1  # the kernel's 24 random bits
    race = -torch.log1p(-(bits + 0.5) / 2**24)  # [rows, V]
    at = stop.clamp(max=k - 1)  # the draft at the stop, if the row stopped before its last
    draft = torch.where(stop < k, drafts.gather(1, at[:, None]).squeeze(1), -1)
    rejected = (draft >= 0) & (draft < vocab)
    if q is not None:
        w = torch.where(rejected[:, None], p - q.double()[at], p)
    else:
        w = p.clone()
        w[rejected, draft[rejected]] = 0.0
    w_key = torch.where(support & (w > 0), w / race, float("-inf"))
    p_key = torch.where(support, p / race, float("-inf"))
    return torch.where(torch.isinf(w_key).all(dim=-1), p_key.argmax(dim=-1), w_key.argmax(dim=-1))


def _run(logits, drafts, *, allowed=None, q=None, block=16, **settings) -> AcceptanceResult:
    """The kernel's result for one step's [k+1, V] logits (and [k+1, V] allowed, [k, V] q) copied to every row
    of `drafts` [rows, k], each row with its own seed; on the CPU. The torch path's accepted drafts and `_race`'s
    emitted tokens, after checking on every `KERNEL_ROWS`-th row that the kernel gives exactly those."""
    rows = drafts.shape[0]
    expand = lambda t: None if t is None else t.expand(rows, *t.shape).contiguous()  # noqa: E731
    seeds = torch.arange(rows) * 7919 + 11
    inputs = dict(
        target_logits=expand(logits),
        draft_tokens=drafts,
        draft_probs=expand(q),
        sampling=SamplingTensors.full(rows, seed=seeds, **settings),
        bitmask=None if allowed is None else expand(pack_bitmask(allowed)),
    )
    expected = accept(**inputs)
    stop = expected.num_accepted
    emitted = _race(logits, drafts, stop, seeds, allowed=allowed, q=q, **settings)
    tokens = expected.tokens.clone()
    tokens[torch.arange(rows), stop] = torch.where(expected.dead_end, -1, emitted)
    expected = AcceptanceResult(stop, tokens, expected.dead_end)

    run = torch.arange(0, rows, KERNEL_ROWS)
    on_device = {
        name: None if value is None else (value.select(run) if name == "sampling" else value[run]).to(DEVICE)
        for name, value in inputs.items()
    }
    with block_size(block):
        result = accept_triton(**on_device)
    for field in ("num_accepted", "tokens", "dead_end"):
        assert torch.equal(getattr(result, field).cpu(), getattr(expected, field)[run]), field
    return expected


def test_one_hot_drafts_under_a_mask_and_temperature():
    generator = torch.Generator().manual_seed(1)
    k = 2
    logits = torch.randn(k + 1, VOCAB, generator=generator) * 1.5
    allowed = random_allowed(generator, (k + 1, VOCAB), density=0.7)
    p = [reference_probs(logits[j], allowed[j], temperature=0.7) for j in range(k + 1)]
    # Half the rows draft the target's favourite, half any token (allowed or not).
    drafts = torch.randint(VOCAB, (ROWS, k), generator=generator)
    drafts[: ROWS // 2] = torch.tensor([int(np.argmax(p[j])) for j in range(k)])
    result = _run(logits, drafts, allowed=allowed, temperature=0.7)

    assert_distributed_as(result.tokens[:, 0], p[0], "first token")
    assert_rate(
        int((result.num_accepted >= 1).sum()), ROWS, float(np.mean(p[0][drafts[:, 0].numpy()])), "acceptance of draft 0"
    )
    second = result.num_accepted >= 1
    assert_distributed_as(result.tokens[second, 1], p[1], "second token given draft 0 accepted")
    emitted = result.tokens.gather(1, result.num_accepted[:, None]).squeeze(1)
    assert allowed[result.num_accepted, emitted].all()  # every emitted token is allowed
    accepted = torch.arange(k) < result.num_accepted[:, None]
    assert allowed[:k].gather(1, drafts.T).T[accepted].all()  # so is every accepted draft
    assert not result.dead_end.any()


def test_sampled_drafts_with_draft_probs_and_min_p():
    generator = torch.Generator().manual_seed(2)
    rows = 1000
    logits = torch.randn(2, VOCAB, generator=generator) * 1.5
    q = (torch.randn(1, VOCAB, generator=generator) * 1.5).softmax(-1)
    drafts = torch.multinomial(q[0], rows, replacement=True, generator=generator)[:, None]
    result = _run(logits, drafts, q=q, min_p=0.2, block=8)  # two blocks per pass: online softmax, race

    p0, p1 = (reference_probs(logits[j], min_p=0.2) for j in range(2))
    assert_distributed_as(result.tokens[:, 0], p0, "first token")
    assert_rate(
        int((result.num_accepted == 1).sum()),
        rows,
        float(np.minimum(p0, q[0].double().numpy()).sum()),
        "acceptance of draft 0",
    )
    bonus = result.num_accepted == 1
    assert_distributed_as(result.tokens[bonus, 1], p1, "bonus token")


def test_placeholder_drafts_give_a_plain_sample_even_with_draft_probs():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, VOCAB, generator=generator)
    q = torch.zeros(1, VOCAB)
    q[0, int(logits[0].argmax())] = 1.0  # subtracting this q would rule the favourite out
    result = _run(logits, torch.full((400, 1), -1), q=q, temperature=1.5)
    assert (result.num_accepted == 0).all()
    assert_distributed_as(result.tokens[:, 0], reference_probs(logits[0], temperature=1.5), "padded position")


def _accept_rows(rows, order, backend=accept_triton):
    logits, drafts, q, bitmask, sampling, thinking = rows
    picked = sampling.select(order)
    with block_size(16):
        result = backend(
            logits[order].to(DEVICE),
            drafts[order].to(DEVICE),
            draft_probs=q[order].to(DEVICE),
            sampling=picked.to(DEVICE),
            bitmask=bitmask[order].to(DEVICE),
            in_thinking=thinking[order].to(DEVICE),
            relaxed=RelaxedAcceptance(top_k=3, delta=0.3),
        )
    return result.tokens.cpu()


def test_a_row_gets_the_same_tokens_whatever_else_is_in_the_batch_and_in_any_order():
    count = 24
    rows = mixed_rows(count, seed=4, k=3, vocab_size=40)
    alone = torch.cat([_accept_rows(rows, torch.tensor([b])) for b in range(count)])
    assert torch.equal(_accept_rows(rows, torch.arange(count)), alone)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(5))
    assert torch.equal(_accept_rows(rows, order), alone[order])
    subset = torch.tensor([5, 23, 0, 17])
    assert torch.equal(_accept_rows(rows, subset), alone[subset])
    # Stochastic rows with top-k/top-p go through the torch path, token for token.
    sampling = rows[4]
    fallback = (((sampling.top_k > 0) | (sampling.top_p < 1)) & (sampling.temperature > 0)).nonzero().squeeze(-1)
    assert torch.equal(alone[fallback], _accept_rows(rows, fallback, backend=accept))


def test_a_dead_end_emits_nothing_in_stochastic_rows():
    logits = torch.zeros(2, 3, 5)
    logits[:, 0, 2] = 50.0  # draft 0 (= 2) is accepted
    logits[:, 1] = float("-inf")
    sampling = SamplingTensors.full(2, seed=torch.arange(2)).to(DEVICE)
    result = accept_triton(logits.to(DEVICE), torch.tensor([[2, 0], [2, 4]], device=DEVICE), sampling=sampling)
    assert result.num_accepted.tolist() == [1, 1]
    assert result.dead_end.tolist() == [True, True]
    assert result.tokens.tolist() == [[2, -1, -1], [2, -1, -1]]
