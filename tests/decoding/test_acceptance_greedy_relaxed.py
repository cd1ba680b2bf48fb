"""Greedy and relaxed acceptance: exact equality with the per-row reference."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.bitmask import pack_bitmask
from tandem.core.rng import STREAM_ACCEPT, uniform
from tandem.decoding import RelaxedAcceptance, SamplingTensors, accept
from tandem.decoding.acceptance import accept_argmax

from .reference import reference_greedy, reference_probs, reference_relaxed_ok
from .strategies import random_allowed


@st.composite
def greedy_batch(draw):
    """A batch on a coarse logit grid (ties are common), drafts that often match, optional masks."""
    batch = draw(st.integers(1, 6))
    k = draw(st.integers(0, 5))
    vocab_size = draw(st.integers(1, 40))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randint(-3, 3, (batch, k + 1, vocab_size), generator=generator).float()
    allowed = None
    if draw(st.booleans()):
        allowed = random_allowed(generator, (batch, k + 1, vocab_size), density=draw(st.sampled_from([0.2, 0.7])))
        if draw(st.booleans()):  # some positions allow nothing
            allowed &= torch.rand(batch, k + 1, 1, generator=generator) > 0.2
    masked = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    drafts = torch.where(
        torch.rand(batch, k, generator=generator) < 0.7,
        masked[:, :k].argmax(-1),
        torch.randint(vocab_size, (batch, k), generator=generator),
    )
    return logits, drafts, allowed


def _bitmask(allowed):
    return None if allowed is None else pack_bitmask(allowed)


@given(greedy_batch())
@settings(max_examples=300)
def test_greedy_equals_reference_ties_and_dead_ends_included(case):
    logits, drafts, allowed = case
    result = accept(logits, drafts, bitmask=_bitmask(allowed))
    for b in range(logits.shape[0]):
        n, tokens, dead = reference_greedy(logits[b], drafts[b], None if allowed is None else allowed[b])
        assert (int(result.num_accepted[b]), result.tokens[b].tolist(), bool(result.dead_end[b])) == (n, tokens, dead)


@given(greedy_batch())
@settings(max_examples=100)
def test_to_host_gives_each_rows_emitted_tokens_acceptance_and_dead_end(case):
    logits, drafts, allowed = case
    result = accept(logits, drafts, bitmask=_bitmask(allowed))
    emitted = [row[:n] for row, n in zip(result.tokens.tolist(), result.num_emitted.tolist())]
    assert result.to_host() == list(zip(emitted, result.num_accepted.tolist(), result.dead_end.tolist()))
    assert all(-1 not in tokens for tokens, _, _ in result.to_host())


@given(greedy_batch())
@settings(max_examples=100)
def test_greedy_fast_path_equals_greedy_rows_of_a_mixed_batch(case):
    logits, drafts, allowed = case
    batch = logits.shape[0]
    greedy = accept(logits, drafts, bitmask=_bitmask(allowed))
    # Greedy rows with filters set, plus one stochastic row that forces the general path.
    temperature = torch.cat([torch.zeros(batch), torch.ones(1)])
    mixed = SamplingTensors(
        temperature,
        torch.full((batch + 1,), 3),
        torch.full((batch + 1,), 0.5),
        torch.full((batch + 1,), 0.1),
        torch.arange(batch + 1),
    )

    def repeat_first(t):
        return None if t is None else torch.cat([t, t[:1]])

    general = accept(
        repeat_first(logits), repeat_first(drafts), sampling=mixed, bitmask=repeat_first(_bitmask(allowed))
    )
    assert torch.equal(general.tokens[:batch], greedy.tokens)
    assert torch.equal(general.num_accepted[:batch], greedy.num_accepted)
    assert torch.equal(general.dead_end[:batch], greedy.dead_end)


@given(greedy_batch(), st.data())
@settings(max_examples=300)
def test_the_host_walk_decides_a_greedy_cpu_batch_as_the_tensor_path_does(case, data):
    logits, drafts, allowed = case
    batch, k = drafts.shape
    vocab_size = logits.shape[-1]
    # Padded and out-of-vocabulary drafts too: never accepted, their positions emit the argmax.
    outside = st.sampled_from([-1, vocab_size, vocab_size + 5])
    for b, j in data.draw(st.sets(st.tuples(st.integers(0, batch - 1), st.integers(0, max(k - 1, 0))))):
        if k:
            drafts[b, j] = data.draw(outside)
    host = accept(logits, drafts, bitmask=_bitmask(allowed))
    tensors = accept(logits, drafts, bitmask=_bitmask(allowed), backend="torch")
    assert host.host is not None and tensors.host is None  # the CPU's greedy batch took the host walk
    assert torch.equal(host.num_accepted, tensors.num_accepted)
    assert torch.equal(host.tokens, tensors.tokens)
    assert torch.equal(host.dead_end, tensors.dead_end)
    assert host.to_host() == tensors.to_host()


@given(greedy_batch(), st.data())
@settings(max_examples=200)
def test_accepting_from_known_argmaxes_decides_an_unmasked_greedy_batch_as_the_tensor_path(case, data):
    """`accept_argmax` (graph mode's argmaxes, chosen with the forward) gives `accept`'s result for unmasked greedy
    logits: ties (the lowest id), padded and out-of-vocabulary drafts included."""
    logits, drafts, _ = case
    batch, k = drafts.shape
    outside = st.sampled_from([-1, logits.shape[-1], logits.shape[-1] + 5])
    for b, j in data.draw(st.sets(st.tuples(st.integers(0, batch - 1), st.integers(0, max(k - 1, 0))))):
        if k:
            drafts[b, j] = data.draw(outside)
    known = accept_argmax(logits.argmax(dim=-1), drafts)
    tensors = accept(logits, drafts, backend="torch")
    assert torch.equal(known.num_accepted, tensors.num_accepted)
    assert torch.equal(known.tokens, tensors.tokens)
    assert not known.dead_end.any() and not tensors.dead_end.any()
    assert known.to_host() == tensors.to_host()


def test_a_stochastic_or_relaxed_batch_keeps_the_tensor_path():
    logits, drafts = torch.zeros(2, 3, 5), torch.zeros(2, 2, dtype=torch.int64)
    stochastic = accept(logits, drafts, sampling=SamplingTensors.full(2, temperature=1.0, seed=torch.arange(2)))
    thinking = torch.ones(2, 3, dtype=torch.bool)
    relaxed = accept(logits, drafts, in_thinking=thinking, relaxed=RelaxedAcceptance(top_k=2, delta=0.1))
    assert stochastic.host is None and relaxed.host is None


@given(greedy_batch(), st.integers(1, 12), st.sampled_from([0.0, 0.1, 0.6, 1.0]), st.booleans())
@settings(max_examples=300)
def test_relaxed_rule_equals_reference(case, top_k, delta, stochastic):
    logits, drafts, allowed = case
    batch, k = drafts.shape
    in_thinking = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(k)) < 0.7
    temperature = 1.0 if stochastic else 0.0
    sampling = SamplingTensors.full(batch, temperature=temperature, seed=torch.arange(batch))
    result = accept(
        logits,
        drafts,
        sampling=sampling,
        bitmask=_bitmask(allowed),
        in_thinking=in_thinking,
        relaxed=RelaxedAcceptance(top_k=top_k, delta=delta),
    )
    u = uniform(sampling.seed, STREAM_ACCEPT, torch.arange(k))  # the row rule's draws, by definition
    for b in range(batch):
        expected_n = k
        for j in range(k):
            row_allowed = None if allowed is None else allowed[b, j]
            draft = int(drafts[b, j])
            p = reference_probs(logits[b, j], row_allowed, temperature=temperature)
            own_ok = p is not None and p[draft] > 0 and float(u[b, j]) <= p[draft]
            relaxed_ok = bool(in_thinking[b, j]) and reference_relaxed_ok(
                logits[b, j], draft, row_allowed, top_k, delta
            )
            if not (own_ok or relaxed_ok):
                expected_n = j
                break
        assert int(result.num_accepted[b]) == expected_n, f"row {b}"
        if expected_n < k and not bool(result.dead_end[b]) and not stochastic:
            p = reference_probs(
                logits[b, expected_n], None if allowed is None else allowed[b, expected_n], temperature=0
            )
            assert int(result.tokens[b, expected_n]) == int(p.argmax())  # rejection emits the row rule's token


@given(greedy_batch())
@settings(max_examples=200)
def test_relaxed_with_top1_and_zero_delta_equals_greedy(case):
    logits, drafts, allowed = case
    batch, k = drafts.shape
    thinking = torch.ones(batch, k + 1, dtype=torch.bool)
    relaxed = accept(
        logits, drafts, bitmask=_bitmask(allowed), in_thinking=thinking, relaxed=RelaxedAcceptance(top_k=1, delta=0.0)
    )
    greedy = accept(logits, drafts, bitmask=_bitmask(allowed))
    assert torch.equal(relaxed.tokens, greedy.tokens)


@given(greedy_batch(), st.integers(1, 12), st.sampled_from([0.1, 0.6, 1.0]))
@settings(max_examples=200)
def test_relaxed_never_accepts_fewer_than_greedy_nor_a_masked_token(case, top_k, delta):
    logits, drafts, allowed = case
    batch, k = drafts.shape
    thinking = torch.ones(batch, k + 1, dtype=torch.bool)
    relaxed = accept(
        logits,
        drafts,
        bitmask=_bitmask(allowed),
        in_thinking=thinking,
        relaxed=RelaxedAcceptance(top_k=top_k, delta=delta),
    )
    greedy = accept(logits, drafts, bitmask=_bitmask(allowed))
    assert (relaxed.num_accepted >= greedy.num_accepted).all()
    if allowed is not None:
        accepted = torch.arange(k) < relaxed.num_accepted[:, None]
        assert allowed[:, :k].gather(-1, drafts[..., None]).squeeze(-1)[accepted].all()


def test_relaxed_applies_only_inside_thinking_positions():
    vocab_size = 8
    logits = torch.zeros(1, 3, vocab_size)
    logits[0, :, 0] = 2.0
    logits[0, :, 1] = 1.9  # second-best, close to the top: relaxed accepts it, greedy does not
    drafts = torch.tensor([[1, 1]])
    relaxed = RelaxedAcceptance(top_k=2, delta=0.5)
    thinking_then_answer = torch.tensor([[True, False, False]])  # `</think>` committed after draft 0
    result = accept(logits, drafts, in_thinking=thinking_then_answer, relaxed=relaxed)
    assert result.num_accepted.tolist() == [1]
    assert result.tokens.tolist() == [[1, 0, -1]]


def test_a_position_with_no_finite_logit_is_a_dead_end_even_without_a_mask():
    logits = torch.zeros(2, 3, 5)
    logits[:, 0, 2] = 50.0  # draft 0 (= 2) is accepted by both rules
    logits[:, 1] = float("-inf")
    for sampling in (None, SamplingTensors.full(2, seed=torch.arange(2))):
        result = accept(logits, torch.tensor([[2, 0], [2, 4]]), sampling=sampling)
        assert result.num_accepted.tolist() == [1, 1]
        assert result.dead_end.tolist() == [True, True]
        assert result.tokens.tolist() == [[2, -1, -1], [2, -1, -1]]
        assert result.num_emitted.tolist() == [1, 1]


def test_top_p_keeps_the_smallest_prefix_reaching_p_with_ties_broken_by_lower_id():
    logits = torch.tensor([[0.0, 0.0, float("-inf")]]).expand(1000, -1)  # p = [0.5, 0.5, 0] exactly
    tokens = accept(
        logits[:, None],
        torch.empty(1000, 0, dtype=torch.int64),
        sampling=SamplingTensors.full(1000, top_p=0.5, seed=torch.arange(1000)),
    ).tokens[:, 0]
    assert (tokens == 0).all()


def test_a_draft_its_own_distribution_ruled_out_is_still_judged_by_the_target():
    # The draft's q gives the drafted token probability 0 (e.g. a reduced draft vocabulary);
    # top-k gives it probability 0 under the target too: it must be rejected.
    vocab_size = 6
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0]]).expand(2, -1)[None].expand(100, -1, -1)
    q = torch.zeros(100, 1, vocab_size)
    q[..., 0] = 1.0
    drafts = torch.full((100, 1), 3)
    result = accept(logits, drafts, draft_probs=q, sampling=SamplingTensors.full(100, top_k=2, seed=torch.arange(100)))
    assert (result.num_accepted == 0).all()
