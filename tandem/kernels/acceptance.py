"""`accept` as one fused Triton kernel: same contract as `tandem.decoding.accept` (the rules are
stated once, in tandem/decoding/acceptance.py; this module only says how it computes them).

One program per row walks the row's positions in order and stops at the first rejection, so a
row that rejects draft n reads only positions 0..n. Each visited position costs one pass over V
that fuses the bitmask unpack, temperature, the online softmax (running max and rescaled sum),
the masked argmax (lowest id among ties) and, for the relaxed rule, the draft's rank; the
emitted token of a stochastic row costs one more pass, an exponential race (Gumbel-max:
argmax_i log w_i - log E_i, E_i ~ Exp(1)) over the residual w = max(p - q, 0), which needs no
normalisation pass. Greedy rows emit the argmax the last pass already found.

What the kernel computes itself: masks, dead ends, greedy, temperature, min-p (one extra max
pass per visited position of a min-p row), draft probabilities, relaxed acceptance, padding.
Stochastic rows with top-k or top-p go through the torch path (`tandem.decoding.accept`)
transparently, row by row, so every row still depends only on its own inputs and seed.

Randomness: the torch path's counter-based hash (tandem/kernels/rng.py), so draws depend only on
the row's seed, never on the batch. The test of draft j uses exactly the torch path's uniform
(STREAM_ACCEPT, counter j), so both paths make the same acceptance decisions (up to float rounding
of p); the race uses STREAM_EMIT with counter = token id, so the emitted token is a different
draw from the same distribution than the torch path's inverse-CDF sample. Greedy and relaxed
decisions use no randomness and equal the torch path exactly; the relaxed rank is counted on
masked logits (softmax is monotone), which agrees with the torch path's rank on float32
probabilities unless distinct logits round to the same probability (underflow far below the top
token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.decoding import AcceptanceResult, RelaxedAcceptance, SamplingTensors, accept
from tandem.decoding.acceptance import check_accept_inputs
from tandem.decoding.rng import STREAM_ACCEPT, STREAM_EMIT
from tandem.kernels.bitmask import allowed_tokens
from tandem.kernels.rng import log_exponential, stream_state, uniform

# Compiled kernels may read only constexpr globals.
_STREAM_ACCEPT = tl.constexpr(STREAM_ACCEPT)
_STREAM_EMIT = tl.constexpr(STREAM_EMIT)
MAX_BLOCK = 4096  # tokens per step of a pass over V (tests lower it to exercise multi-block passes)


@triton.jit
def _masked_logits(logit_row, mask_row, ids, vocab_size, HAS_MASK: tl.constexpr):
    """float32 block of logits with forbidden (and out-of-vocabulary) tokens at -inf."""
    in_vocab = ids < vocab_size
    x = tl.load(logit_row + ids, mask=in_vocab, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        x = tl.where(allowed_tokens(mask_row, ids, in_vocab), x, float("-inf"))
    return x


@triton.jit
def _max_pass(logit_row, mask_row, vocab_size, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """max of the masked logits (the min-p threshold needs it before the sum)."""
    best = float("-inf")
    for start in range(0, vocab_size, BLOCK):
        x = _masked_logits(logit_row, mask_row, start + tl.arange(0, BLOCK), vocab_size, HAS_MASK)
        best = tl.maximum(best, tl.max(x, 0))
    return best


@triton.jit
def _position_pass(logit_row, mask_row, vocab_size, temperature, threshold, draft, draft_logit,
                   HAS_MASK: tl.constexpr, STOCHASTIC: tl.constexpr, RELAXED: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over a position's masked logits x.

    returns: top (max x, -inf at a dead end), argmax (lowest id among ties), sum_t = sum of
    exp((x - top) / temperature) over tokens with x >= threshold (STOCHASTIC), sum_raw = sum of
    exp(x - top) (RELAXED), ahead = tokens ranked before the draft, ties by lower id (RELAXED).
    """
    top = float("-inf")
    argmax = 0
    sum_t = 0.0
    sum_raw = 0.0
    ahead = 0
    for start in range(0, vocab_size, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        x = _masked_logits(logit_row, mask_row, ids, vocab_size, HAS_MASK)
        block_top = tl.max(x, 0)
        block_argmax = tl.min(tl.where(x == block_top, ids, vocab_size), 0)
        new_top = tl.maximum(top, block_top)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # keeps -inf - -inf out
        if STOCHASTIC:
            kept = tl.exp((x - shift) / temperature)
            kept = tl.where(x >= threshold, kept, 0.0)
            sum_t = sum_t * tl.exp((top - shift) / temperature) + tl.sum(kept, 0)
        if RELAXED:
            sum_raw = sum_raw * tl.exp(top - shift) + tl.sum(tl.exp(x - shift), 0)
            before = (x > draft_logit) | ((x == draft_logit) & (ids < draft))
            ahead += tl.sum(before.to(tl.int32), 0)
        argmax = tl.where(block_top > top, block_argmax, argmax)  # earlier blocks win ties
        top = new_top
    return top, argmax, sum_t, sum_raw, ahead


@triton.jit
def _race(logit_row, mask_row, q_row, vocab_size, temperature, threshold, top, sum_t, excluded, use_q, seed,
          HAS_MASK: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    """Sample of norm(w), w = max(p - q, 0) with q = q_row if use_q, else w = p without token
    `excluded` (-1: none); a sample of p where w is all zero; -1 at a dead end.

    p = the position's target distribution: exp((x - top) / temperature) / sum_t on x >= threshold.
    """
    emit_state = stream_state(seed, _STREAM_EMIT)  # counter = token id
    best_w_key = float("-inf")
    best_w = -1
    best_p_key = float("-inf")
    best_p = -1
    for start in range(0, vocab_size, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        x = _masked_logits(logit_row, mask_row, ids, vocab_size, HAS_MASK)
        support = (x > float("-inf")) & (x >= threshold)
        log_exp = log_exponential(emit_state, ids)
        z = (x - top) / temperature
        p_key = tl.where(support, z - log_exp, float("-inf"))
        if HAS_Q:
            q = tl.load(q_row + ids, mask=ids < tl.where(use_q, vocab_size, 0), other=0.0).to(tl.float32)
            w = tl.exp(z) / sum_t - q
            w_key = tl.where(support & (w > 0), tl.log(tl.where(w > 0, w, 1.0)) - log_exp, float("-inf"))
        else:
            w_key = p_key
        w_key = tl.where(ids == excluded, float("-inf"), w_key)
        block_w_key = tl.max(w_key, 0)
        block_p_key = tl.max(p_key, 0)
        best_w = tl.where(block_w_key > best_w_key, tl.min(tl.where(w_key == block_w_key, ids, vocab_size), 0), best_w)
        best_p = tl.where(block_p_key > best_p_key, tl.min(tl.where(p_key == block_p_key, ids, vocab_size), 0), best_p)
        best_w_key = tl.maximum(best_w_key, block_w_key)
        best_p_key = tl.maximum(best_p_key, block_p_key)
    return tl.where(best_w >= 0, best_w, best_p)


@triton.jit
def _accept_kernel(
    logits_ptr, logits_stride_b, logits_stride_j,
    mask_ptr, mask_stride_b, mask_stride_j,
    drafts_ptr, drafts_stride_b,
    q_ptr, q_stride_b, q_stride_j,
    thinking_ptr, thinking_stride_b,
    temperature_ptr, min_p_ptr, seed_ptr, row_ids_ptr,
    tokens_ptr, num_accepted_ptr, dead_end_ptr,
    num_drafts, vocab_size, relaxed_top_k, relaxed_delta,
    HAS_MASK: tl.constexpr, HAS_Q: tl.constexpr, STOCHASTIC: tl.constexpr, RELAXED: tl.constexpr,
    INDEXED: tl.constexpr, BLOCK: tl.constexpr, POSITIONS_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if INDEXED:
        row = tl.load(row_ids_ptr + row)
    temperature = 0.0
    min_p = 0.0
    seed = 0
    if STOCHASTIC:
        temperature = tl.load(temperature_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        seed = tl.load(seed_ptr + row)
    stochastic = temperature > 0
    safe_temperature = tl.where(stochastic, temperature, 1.0)
    positions = tl.arange(0, POSITIONS_BLOCK)
    if STOCHASTIC:  # the acceptance tests' uniforms, one per draft position, drawn at once
        u_accept = uniform(stream_state(seed, _STREAM_ACCEPT), positions)

    # Walk positions until the first rejection; position num_drafts (the bonus) always stops.
    pos = 0
    walking = True
    top = float("-inf")
    argmax = 0
    sum_t = 0.0
    threshold = float("-inf")
    draft = tl.full((), -1, tl.int64)
    draft_ok = False
    while walking:
        logit_row = logits_ptr + row * logits_stride_b + pos * logits_stride_j
        mask_row = mask_ptr + row * mask_stride_b + pos * mask_stride_j
        draft = tl.load(drafts_ptr + row * drafts_stride_b + pos, mask=pos < num_drafts, other=-1)
        draft_ok = (draft >= 0) & (draft < vocab_size)
        safe_draft = tl.where(draft_ok, draft, 0)
        draft_logit = tl.load(logit_row + safe_draft).to(tl.float32)
        draft_allowed = draft_ok
        if HAS_MASK:
            draft_allowed &= allowed_tokens(mask_row, safe_draft, draft_ok)
        draft_logit = tl.where(draft_allowed, draft_logit, float("-inf"))
        threshold = float("-inf")
        if STOCHASTIC:
            if stochastic & (min_p > 0):
                threshold = _max_pass(logit_row, mask_row, vocab_size, HAS_MASK, BLOCK) + temperature * tl.log(min_p)
        top, argmax, sum_t, sum_raw, ahead = _position_pass(
            logit_row, mask_row, vocab_size, safe_temperature, threshold, draft, draft_logit,
            HAS_MASK, STOCHASTIC, RELAXED, BLOCK)
        eligible = draft_allowed & (top > float("-inf"))
        safe_top = tl.where(eligible, top, 0.0)  # a dead end's top is -inf; its draft is rejected anyway
        accepted = draft == argmax
        if STOCHASTIC:
            p_draft = tl.exp((draft_logit - safe_top) / safe_temperature) / tl.where(eligible, sum_t, 1.0)
            p_draft = tl.where(draft_logit >= threshold, p_draft, 0.0)
            q_draft = 1.0
            if HAS_Q:
                q_draft = tl.load(q_ptr + row * q_stride_b + pos * q_stride_j + safe_draft).to(tl.float32)
            u = tl.sum(tl.where(positions == pos, u_accept, 0.0), 0)
            accepted = tl.where(stochastic, (p_draft > 0) & (u * q_draft <= p_draft), accepted)
        if RELAXED:
            thinking = tl.load(thinking_ptr + row * thinking_stride_b + pos) != 0
            safe_sum = tl.where(eligible, sum_raw, 1.0)
            close = tl.exp(draft_logit - safe_top) / safe_sum >= 1.0 / safe_sum - relaxed_delta
            accepted |= thinking & (ahead < relaxed_top_k) & close
        walking = accepted & eligible
        pos += walking.to(tl.int32)

    dead_end = top == float("-inf")
    emitted = argmax
    if STOCHASTIC:
        if stochastic & (top > float("-inf")):
            rejected_draft = (pos < num_drafts) & draft_ok
            excluded = tl.full((), -1, tl.int64)
            if not HAS_Q:  # one-hot q: the residual is p without the rejected draft
                excluded = tl.where(rejected_draft, draft, -1)
            emitted = _race(
                logits_ptr + row * logits_stride_b + pos * logits_stride_j,
                mask_ptr + row * mask_stride_b + pos * mask_stride_j,
                q_ptr + row * q_stride_b + pos * q_stride_j,
                vocab_size, safe_temperature, threshold, top, sum_t, excluded, rejected_draft, seed,
                HAS_MASK, HAS_Q, BLOCK)
    emitted = tl.where(dead_end, -1, emitted)

    drafts = tl.load(drafts_ptr + row * drafts_stride_b + positions, mask=positions < num_drafts, other=-1)
    tokens = tl.where(positions < pos, drafts, tl.where(positions == pos, emitted.to(tl.int64), -1))
    tl.store(tokens_ptr + row * (num_drafts + 1) + positions, tokens, mask=positions <= num_drafts)
    tl.store(num_accepted_ptr + row, pos.to(tl.int64))
    tl.store(dead_end_ptr + row, dead_end.to(tl.int8))


def accept_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    sampling: SamplingTensors | None = None,
    bitmask: torch.Tensor | None = None,
    in_thinking: torch.Tensor | None = None,
    relaxed: RelaxedAcceptance | None = None,
) -> AcceptanceResult:
    """`tandem.decoding.accept` with the fused kernel (module docstring); same arguments and result.

    target_logits: [B, k+1, V] float32/bfloat16/float16, last dim contiguous
    draft_tokens:  [B, k] int64
    draft_probs:   [B, k, V] float or None
    sampling:      [B] settings or None (all greedy)
    bitmask:       [B, k+1, ceil(V/32)] int32 or None
    in_thinking:   [B, k+1] bool or None
    relaxed:       RelaxedAcceptance or None
    Does not modify its inputs. Stochastic rows with top-k/top-p are computed by the torch path.
    """
    check_accept_inputs(target_logits, draft_tokens, draft_probs, sampling, bitmask, in_thinking, relaxed)
    batch, num_positions, vocab_size = target_logits.shape
    if vocab_size == 0:
        raise ValueError(f"target_logits must have a vocabulary of at least 1 token, got shape {list(target_logits.shape)}")
    device = target_logits.device
    tokens = torch.empty(batch, num_positions, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    dead_end = torch.empty(batch, dtype=torch.int8, device=device)
    stochastic = sampling is not None and not sampling.all_greedy
    fallback = None
    if stochastic and sampling.any_top_k_top_p:
        fallback = ((sampling.top_k > 0) | (sampling.top_p < 1)) & (sampling.temperature > 0)
    kernel_rows = None if fallback is None else (~fallback).nonzero().squeeze(-1)
    num_kernel_rows = batch if kernel_rows is None else kernel_rows.numel()

    if num_kernel_rows:
        logits = _vocab_contiguous(target_logits)
        mask = None if bitmask is None else _vocab_contiguous(bitmask)
        q = None if draft_probs is None else _vocab_contiguous(draft_probs)
        drafts = draft_tokens.contiguous()
        thinking = None if relaxed is None or in_thinking is None else in_thinking.contiguous().view(torch.uint8)
        dummy = logits  # stands in for absent optional tensors; never read (constexpr flags)
        temperature, min_p, seed = (sampling.temperature, sampling.min_p, sampling.seed) if stochastic else (dummy,) * 3
        block = min(MAX_BLOCK, triton.next_power_of_2(vocab_size))
        _accept_kernel[(num_kernel_rows,)](
            logits, logits.stride(0), logits.stride(1),
            *(_or(mask, dummy), *_strides(mask, 2)),
            drafts, drafts.stride(0),
            *(_or(q, dummy), *_strides(q, 2)),
            *(_or(thinking, dummy), *_strides(thinking, 1)),
            temperature, min_p, seed, _or(kernel_rows, dummy),
            tokens, num_accepted, dead_end,
            num_positions - 1, vocab_size,
            relaxed.top_k if relaxed is not None else 0, float(relaxed.delta) if relaxed is not None else 0.0,
            HAS_MASK=mask is not None, HAS_Q=q is not None, STOCHASTIC=stochastic, RELAXED=thinking is not None,
            INDEXED=kernel_rows is not None, BLOCK=block, POSITIONS_BLOCK=triton.next_power_of_2(num_positions),
            num_warps=16 if block >= 2048 else 4,
        )
    result = AcceptanceResult(num_accepted=num_accepted, tokens=tokens, dead_end=dead_end.view(torch.bool))
    if fallback is not None and num_kernel_rows < batch:
        _merge_torch_rows(result, fallback.nonzero().squeeze(-1), target_logits, draft_tokens,
                          draft_probs, sampling, bitmask, in_thinking, relaxed)
    return result


def _merge_torch_rows(
    result: AcceptanceResult,
    rows: torch.Tensor,
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingTensors,
    bitmask: torch.Tensor | None,
    in_thinking: torch.Tensor | None,
    relaxed: RelaxedAcceptance | None,
) -> None:
    """Compute `rows` ([R] int64 row ids) with the torch path and write them into `result` (in place)."""
    pick = lambda value: None if value is None else value[rows]  # noqa: E731
    subset = SamplingTensors(*(getattr(sampling, name)[rows] for name in ("temperature", "top_k", "top_p", "min_p", "seed")))
    torch_result = accept(target_logits[rows], draft_tokens[rows], draft_probs=pick(draft_probs), sampling=subset,
                          bitmask=pick(bitmask), in_thinking=pick(in_thinking), relaxed=relaxed, backend="torch")
    result.num_accepted[rows] = torch_result.num_accepted
    result.tokens[rows] = torch_result.tokens
    result.dead_end[rows] = torch_result.dead_end


def _vocab_contiguous(value: torch.Tensor) -> torch.Tensor:
    """`value` with a unit stride in its last dim (copied only if needed)."""
    return value if value.stride(-1) == 1 else value.contiguous()


def _or(value: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if value is None else value


def _strides(value: torch.Tensor | None, count: int) -> tuple[int, ...]:
    return (0,) * count if value is None else tuple(value.stride()[:count])
