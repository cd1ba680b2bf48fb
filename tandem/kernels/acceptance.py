"""`accept` as fused Triton kernels: the rules are stated once, in tandem/decoding/acceptance.py,
whose `accept` dispatches here for CUDA tensors; this module only says how it computes them.

Every pass over V is split into chunks of BLOCK tokens, one program each, so a call fills the GPU
at batch 1 as well as at 256 (one program per row walking V serially is latency-bound: a single
row would leave most of the GPU idle). A call launches, in order:

1. `_chunk_stats_kernel`, grid (rows, k+1, chunks): every position of every row, before any
   acceptance is known, in one pass over its chunk that fuses the bitmask unpack, temperature,
   min-p, the chunk's max and argmax (lowest id among ties), its softmax sum relative to its own
   max and, for the relaxed rule, the count of tokens ranked before the draft. Reading positions
   past the first rejection costs bytes, but no pass waits for another.
2. `_walk_kernel`, one program per row: combines each position's chunks (rescaling the sums to
   the position's max), decides every position's draft at once, stops at the first rejection
   and writes the row's result; greedy rows emit the argmax the combine found.
3. Stochastic rows only: `_race_kernel`, grid (rows, chunks), one more pass over the stopping
   position for an exponential race (argmax_i w_i / E_i with E_i ~ Exp(1) picks i with
   probability w_i / sum(w): the Gumbel-max trick without its logarithms) over the residual
   w = max(p - q, 0), which needs no normalisation pass; `_race_finish_kernel`
   picks each row's winner among its chunks.
Rows with min-p need a position's max before its sum: `_chunk_max_kernel` runs first for them.

What the kernels compute themselves: masks, dead ends, greedy, temperature, min-p, draft
probabilities, relaxed acceptance, padding.
Stochastic rows with top-k or top-p are left to the torch path: the caller (`tandem.decoding.accept`)
passes the other rows as `rows` and computes those itself, so every row still depends only on its
own inputs and seed.

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

from tandem.core.rng import STREAM_ACCEPT, STREAM_EMIT
from tandem.kernels.bitmask import allowed_tokens
from tandem.kernels.rng import exponential, stream_state, uniform

# Compiled kernels may read only constexpr globals.
_STREAM_ACCEPT = tl.constexpr(STREAM_ACCEPT)
_STREAM_EMIT = tl.constexpr(STREAM_EMIT)
MAX_BLOCK = 4096  # vocabulary tokens per program (tests lower it to exercise many chunks per pass)


@triton.jit
def _chunk_logits(
    logit_row, mask_row, chunk, vocab_size, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr
):
    """(ids, x): a chunk's token ids and float32 logits, forbidden (and out-of-vocabulary) tokens at
    -inf, as [BLOCK / ROW, ROW] tiles. ROW divides 32, so each tile row lies in one bitmask word,
    loaded once for the row instead of once per token."""
    starts = chunk * BLOCK + tl.arange(0, BLOCK // ROW)[:, None] * ROW
    ids = starts + tl.arange(0, ROW)[None, :]
    x = tl.load(logit_row + ids, mask=ids < vocab_size, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        words = tl.load(mask_row + starts // 32, mask=starts < vocab_size, other=0)
        x = tl.where(((words >> (ids % 32)) & 1) != 0, x, float("-inf"))
    return ids, x


@triton.jit
def _row_index(row_ids_ptr, r, INDEXED: tl.constexpr):
    """The batch row that program row `r` computes (rows with top-k/top-p are left to torch)."""
    row = r.to(tl.int64)
    if INDEXED:
        row = tl.load(row_ids_ptr + row)
    return row


@triton.jit
def _row_settings(temperature_ptr, min_p_ptr, seed_ptr, row, STOCHASTIC: tl.constexpr):
    """(stochastic, temperature to divide by (1.0 for greedy rows), min_p, seed) of one row."""
    temperature = 0.0
    min_p = 0.0
    seed = 0
    if STOCHASTIC:
        temperature = tl.load(temperature_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        seed = tl.load(seed_ptr + row)
    stochastic = temperature > 0
    return stochastic, tl.where(stochastic, temperature, 1.0), min_p, seed


@triton.jit
def _draft_at(
    drafts_ptr, drafts_stride_b, logit_row, mask_row, row, pos, num_drafts, vocab_size, HAS_MASK: tl.constexpr
):
    """(draft id or -1 past the drafts, is a real token, is a real token the mask allows, its logit:
    -inf if not allowed); `pos` and the row pointers may be vectors of positions."""
    draft = tl.load(drafts_ptr + row * drafts_stride_b + pos, mask=pos < num_drafts, other=-1)
    draft_ok = (draft >= 0) & (draft < vocab_size)
    safe_draft = tl.where(draft_ok, draft, 0)
    allowed = draft_ok
    if HAS_MASK:
        allowed &= allowed_tokens(mask_row, safe_draft, draft_ok)
    draft_logit = tl.load(logit_row + safe_draft, mask=draft_ok, other=float("-inf")).to(tl.float32)
    return draft, draft_ok, allowed, tl.where(allowed, draft_logit, float("-inf"))


@triton.jit
def _threshold(top, temperature, min_p, stochastic, HAS_MIN_P: tl.constexpr):
    """min-p cut on masked logits: x >= top + T log(min_p) <=> p(x) >= min_p * p_max (-inf: none)."""
    threshold = float("-inf")
    if HAS_MIN_P:
        cut = stochastic & (min_p > 0)
        threshold = tl.where(cut, top + temperature * tl.log(tl.where(cut, min_p, 1.0)), float("-inf"))
    return threshold


@triton.jit
def _chunk_max_kernel(
    logits_ptr,
    logits_stride_b,
    logits_stride_j,
    mask_ptr,
    mask_stride_b,
    mask_stride_j,
    row_ids_ptr,
    max_ptr,
    num_chunks,
    vocab_size,
    HAS_MASK: tl.constexpr,
    INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW: tl.constexpr,
):
    """max_ptr[r, pos, chunk] = max of the chunk's masked logits (min-p needs the max before the sum)."""
    r, pos, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = _row_index(row_ids_ptr, r, INDEXED)
    _, x = _chunk_logits(
        logits_ptr + row * logits_stride_b + pos * logits_stride_j,
        mask_ptr + row * mask_stride_b + pos * mask_stride_j,
        chunk,
        vocab_size,
        HAS_MASK,
        BLOCK,
        ROW,
    )
    slot = (r.to(tl.int64) * tl.num_programs(1) + pos) * num_chunks + chunk
    tl.store(max_ptr + slot, tl.max(x))


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,
    logits_stride_b,
    logits_stride_j,
    mask_ptr,
    mask_stride_b,
    mask_stride_j,
    drafts_ptr,
    drafts_stride_b,
    temperature_ptr,
    min_p_ptr,
    seed_ptr,
    row_ids_ptr,
    max_ptr,
    top_ptr,
    argmax_ptr,
    sum_t_ptr,
    sum_raw_ptr,
    ahead_ptr,
    num_drafts,
    num_chunks,
    vocab_size,
    HAS_MASK: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    RELAXED: tl.constexpr,
    INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    """Statistics of one chunk of one position's masked logits x, at [r, pos, chunk] of each output:
    top (max x), argmax (lowest id among ties), sum_t = sum of exp((x - top) / T) over x >= the
    min-p threshold (STOCHASTIC), sum_raw = sum of exp(x - top) and ahead = tokens ranked before
    the draft, ties by lower id (RELAXED)."""
    r, pos, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = _row_index(row_ids_ptr, r, INDEXED)
    logit_row = logits_ptr + row * logits_stride_b + pos * logits_stride_j
    mask_row = mask_ptr + row * mask_stride_b + pos * mask_stride_j
    ids, x = _chunk_logits(logit_row, mask_row, chunk, vocab_size, HAS_MASK, BLOCK, ROW)
    top = tl.max(x)
    shift = tl.where(top == float("-inf"), 0.0, top)
    slot = (r.to(tl.int64) * tl.num_programs(1) + pos) * num_chunks + chunk
    tl.store(top_ptr + slot, top)
    tl.store(argmax_ptr + slot, tl.min(tl.where(x == top, ids, vocab_size)))
    if STOCHASTIC:
        stochastic, temperature, min_p, _ = _row_settings(temperature_ptr, min_p_ptr, seed_ptr, row, STOCHASTIC)
        threshold = float("-inf")
        if HAS_MIN_P:
            chunks = tl.arange(0, CHUNKS_BLOCK)
            maxima = tl.load(max_ptr + (slot - chunk) + chunks, mask=chunks < num_chunks, other=float("-inf"))
            threshold = _threshold(tl.max(maxima, 0), temperature, min_p, stochastic, HAS_MIN_P)
        kept = tl.where(x >= threshold, tl.exp((x - shift) / temperature), 0.0)
        tl.store(sum_t_ptr + slot, tl.sum(kept))
    if RELAXED:
        draft, _, _, draft_logit = _draft_at(
            drafts_ptr, drafts_stride_b, logit_row, mask_row, row, pos, num_drafts, vocab_size, HAS_MASK
        )
        before = (x > draft_logit) | ((x == draft_logit) & (ids < draft))
        tl.store(sum_raw_ptr + slot, tl.sum(tl.exp(x - shift)))
        tl.store(ahead_ptr + slot, tl.sum(before.to(tl.int32)))


@triton.jit
def _combine_chunks(
    top_ptr,
    argmax_ptr,
    sum_t_ptr,
    sum_raw_ptr,
    ahead_ptr,
    bases,
    live,
    num_chunks,
    vocab_size,
    temperature,
    STOCHASTIC: tl.constexpr,
    RELAXED: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    """Positions' statistics over all of V from their chunks', the chunks of position i at
    [bases[i], bases[i] + num_chunks) (positions where `live` is False read nothing):
    [N] vectors (top, argmax, sum_t, sum_raw, ahead) as `_chunk_stats_kernel` defines them."""
    chunks = tl.arange(0, CHUNKS_BLOCK)[None, :]
    offsets = bases[:, None] + chunks
    valid = live[:, None] & (chunks < num_chunks)
    tops = tl.load(top_ptr + offsets, mask=valid, other=float("-inf"))
    top = tl.max(tops, 1)
    # Chunks are in id order and each holds its lowest top id: the lowest over chunks at the top wins.
    at_top = valid & (tops == top[:, None])
    argmax = tl.min(tl.where(at_top, tl.load(argmax_ptr + offsets, mask=valid, other=0), vocab_size), 1)
    shift = tl.where(top == float("-inf"), 0.0, top)[:, None]  # keeps -inf - -inf out
    seen = tops > float("-inf")
    sum_t = tl.zeros_like(top)
    sum_raw = tl.zeros_like(top)
    ahead = tl.zeros_like(argmax)
    if STOCHASTIC:  # chunk sums were taken relative to their own max: rescale to the position's
        sums = tl.load(sum_t_ptr + offsets, mask=valid, other=0.0)
        sum_t = tl.sum(tl.where(seen, sums * tl.exp((tops - shift) / temperature), 0.0), 1)
    if RELAXED:
        sums = tl.load(sum_raw_ptr + offsets, mask=valid, other=0.0)
        sum_raw = tl.sum(tl.where(seen, sums * tl.exp(tops - shift), 0.0), 1)
        ahead = tl.sum(tl.load(ahead_ptr + offsets, mask=valid, other=0), 1)
    return top, argmax, sum_t, sum_raw, ahead


@triton.jit
def _walk_kernel(
    logits_ptr,
    logits_stride_b,
    logits_stride_j,
    mask_ptr,
    mask_stride_b,
    mask_stride_j,
    drafts_ptr,
    drafts_stride_b,
    q_ptr,
    q_stride_b,
    q_stride_j,
    thinking_ptr,
    thinking_stride_b,
    temperature_ptr,
    min_p_ptr,
    seed_ptr,
    row_ids_ptr,
    top_ptr,
    argmax_ptr,
    sum_t_ptr,
    sum_raw_ptr,
    ahead_ptr,
    tokens_ptr,
    num_accepted_ptr,
    dead_end_ptr,
    num_drafts,
    num_chunks,
    vocab_size,
    relaxed_top_k,
    relaxed_delta,
    HAS_MASK: tl.constexpr,
    HAS_Q: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    RELAXED: tl.constexpr,
    INDEXED: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
    POSITIONS_BLOCK: tl.constexpr,
):
    """One row: decide every position's draft at once (each decision reads only its own
    position), stop at the first rejection (the bonus position always stops) and write the row's
    outputs; a stochastic row's emitted token is left to the race kernels."""
    r = tl.program_id(0)
    row = _row_index(row_ids_ptr, r, INDEXED)
    stochastic, temperature, min_p, seed = _row_settings(temperature_ptr, min_p_ptr, seed_ptr, row, STOCHASTIC)
    positions = tl.arange(0, POSITIONS_BLOCK)
    live = positions <= num_drafts
    draft, draft_ok, draft_allowed, draft_logit = _draft_at(
        drafts_ptr,
        drafts_stride_b,
        logits_ptr + row * logits_stride_b + positions * logits_stride_j,
        mask_ptr + row * mask_stride_b + positions * mask_stride_j,
        row,
        positions,
        num_drafts,
        vocab_size,
        HAS_MASK,
    )
    top, argmax, sum_t, sum_raw, ahead = _combine_chunks(
        top_ptr,
        argmax_ptr,
        sum_t_ptr,
        sum_raw_ptr,
        ahead_ptr,
        (r.to(tl.int64) * (num_drafts + 1) + positions) * num_chunks,
        live,
        num_chunks,
        vocab_size,
        temperature,
        STOCHASTIC,
        RELAXED,
        CHUNKS_BLOCK,
    )
    eligible = draft_allowed & (top > float("-inf"))
    safe_top = tl.where(eligible, top, 0.0)  # a dead end's top is -inf; its draft is rejected anyway
    accepted = draft == argmax
    if STOCHASTIC:
        u = uniform(stream_state(seed, _STREAM_ACCEPT), positions)  # the torch path's test of draft j
        threshold = _threshold(top, temperature, min_p, stochastic, HAS_MIN_P)
        p_draft = tl.exp((draft_logit - safe_top) / temperature) / tl.where(eligible, sum_t, 1.0)
        p_draft = tl.where(draft_logit >= threshold, p_draft, 0.0)
        q_draft = 1.0
        if HAS_Q:
            q_rows = q_ptr + row * q_stride_b + positions * q_stride_j
            q_draft = tl.load(q_rows + draft, mask=draft_ok, other=1.0).to(tl.float32)
        accepted = tl.where(stochastic, (p_draft > 0) & (u * q_draft <= p_draft), accepted)
    if RELAXED:
        thinking = tl.load(thinking_ptr + row * thinking_stride_b + positions, mask=live, other=0) != 0
        safe_sum = tl.where(eligible, sum_raw, 1.0)
        close = tl.exp(draft_logit - safe_top) / safe_sum >= 1.0 / safe_sum - relaxed_delta
        accepted |= thinking & (ahead < relaxed_top_k) & close
    pos = tl.min(tl.where(accepted & eligible, POSITIONS_BLOCK, positions), 0)  # the first rejection

    at_pos = positions == pos
    dead_end = tl.max(tl.where(at_pos, top, float("-inf")), 0) == float("-inf")
    emitted = tl.where(dead_end, -1, tl.max(tl.where(at_pos, argmax, -1), 0)).to(tl.int64)
    tokens = tl.where(positions < pos, draft, tl.where(at_pos, emitted, -1))
    tl.store(tokens_ptr + row * (num_drafts + 1) + positions, tokens, mask=live)
    tl.store(num_accepted_ptr + row, pos.to(tl.int64))
    tl.store(dead_end_ptr + row, dead_end.to(tl.int8))


@triton.jit
def _race_kernel(
    logits_ptr,
    logits_stride_b,
    logits_stride_j,
    mask_ptr,
    mask_stride_b,
    mask_stride_j,
    drafts_ptr,
    drafts_stride_b,
    q_ptr,
    q_stride_b,
    q_stride_j,
    temperature_ptr,
    min_p_ptr,
    seed_ptr,
    row_ids_ptr,
    top_ptr,
    argmax_ptr,
    sum_t_ptr,
    num_accepted_ptr,
    dead_end_ptr,
    w_key_ptr,
    w_id_ptr,
    p_key_ptr,
    p_id_ptr,
    num_drafts,
    num_chunks,
    vocab_size,
    HAS_MASK: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """One chunk of a stochastic row's exponential race at the position where its walk stopped:
    the best key and its id (lowest among ties) for the residual w = max(p - q, 0), where q = the
    row's draft probabilities if the draft there was rejected, else w = p without the rejected
    draft (one-hot q) or w = p (bonus position); and for p itself (the fallback where w is all
    zero). p = exp((x - top) / T) / sum_t on x >= the min-p threshold. Keys at [r, chunk]."""
    r, chunk = tl.program_id(0), tl.program_id(1)
    row = _row_index(row_ids_ptr, r, INDEXED)
    stochastic, temperature, min_p, seed = _row_settings(temperature_ptr, min_p_ptr, seed_ptr, row, True)
    if stochastic & (tl.load(dead_end_ptr + row) == 0):
        pos = tl.load(num_accepted_ptr + row)
        logit_row = logits_ptr + row * logits_stride_b + pos * logits_stride_j
        mask_row = mask_ptr + row * mask_stride_b + pos * mask_stride_j
        draft, draft_ok, _, _ = _draft_at(
            drafts_ptr, drafts_stride_b, logit_row, mask_row, row, pos, num_drafts, vocab_size, HAS_MASK
        )
        one = tl.zeros([1], dtype=tl.int64)
        top, _, sum_t, _, _ = _combine_chunks(
            top_ptr,
            argmax_ptr,
            sum_t_ptr,
            sum_t_ptr,
            argmax_ptr,
            one + (r.to(tl.int64) * (num_drafts + 1) + pos) * num_chunks,
            one == 0,
            num_chunks,
            vocab_size,
            temperature,
            True,
            False,
            CHUNKS_BLOCK,
        )
        top, sum_t = tl.max(top, 0), tl.sum(sum_t, 0)
        threshold = _threshold(top, temperature, min_p, stochastic, HAS_MIN_P)
        rejected_draft = (pos < num_drafts) & draft_ok
        excluded = tl.full((), -1, tl.int64)
        if not HAS_Q:  # one-hot q: the residual is p without the rejected draft
            excluded = tl.where(rejected_draft, draft, -1)

        ids, x = _chunk_logits(logit_row, mask_row, chunk, vocab_size, HAS_MASK, BLOCK, ROW)
        support = (x > float("-inf")) & (x >= threshold)
        race = exponential(stream_state(seed, _STREAM_EMIT), ids, FAST_LOG)  # counter = token id
        p = tl.exp((x - top) / temperature)  # sum_t * the target probability
        p_key = tl.where(support, p / race, float("-inf"))
        if HAS_Q:
            q = tl.load(
                q_ptr + row * q_stride_b + pos * q_stride_j + ids,
                mask=ids < tl.where(rejected_draft, vocab_size, 0),
                other=0.0,
            ).to(tl.float32)
            w = p / sum_t - q
            w_key = tl.where(support & (w > 0), w / race, float("-inf"))
        else:
            w_key = p_key
        w_key = tl.where(ids == excluded, float("-inf"), w_key)
        slot = r.to(tl.int64) * num_chunks + chunk
        best_w_key = tl.max(w_key)
        best_p_key = tl.max(p_key)
        tl.store(w_key_ptr + slot, best_w_key)
        tl.store(w_id_ptr + slot, tl.min(tl.where(w_key == best_w_key, ids, vocab_size)))
        tl.store(p_key_ptr + slot, best_p_key)
        tl.store(p_id_ptr + slot, tl.min(tl.where(p_key == best_p_key, ids, vocab_size)))


@triton.jit
def _race_winner(key_ptr, id_ptr, base, num_chunks, vocab_size, CHUNKS_BLOCK: tl.constexpr):
    """(best key, its id: lowest among ties) over a row's chunk results at [base, base + num_chunks)."""
    chunks = tl.arange(0, CHUNKS_BLOCK)
    valid = chunks < num_chunks
    keys = tl.load(key_ptr + base + chunks, mask=valid, other=float("-inf"))
    best = tl.max(keys, 0)
    ids = tl.load(id_ptr + base + chunks, mask=valid, other=0)
    return best, tl.min(tl.where(valid & (keys == best), ids, vocab_size), 0)


@triton.jit
def _race_finish_kernel(
    temperature_ptr,
    row_ids_ptr,
    num_accepted_ptr,
    dead_end_ptr,
    w_key_ptr,
    w_id_ptr,
    p_key_ptr,
    p_id_ptr,
    tokens_ptr,
    num_drafts,
    num_chunks,
    vocab_size,
    INDEXED: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    """A stochastic row's emitted token: the race winner over its chunks (w's, or p's where w is all zero)."""
    r = tl.program_id(0)
    row = _row_index(row_ids_ptr, r, INDEXED)
    if (tl.load(temperature_ptr + row) > 0) & (tl.load(dead_end_ptr + row) == 0):
        base = r.to(tl.int64) * num_chunks
        best_w_key, best_w = _race_winner(w_key_ptr, w_id_ptr, base, num_chunks, vocab_size, CHUNKS_BLOCK)
        _, best_p = _race_winner(p_key_ptr, p_id_ptr, base, num_chunks, vocab_size, CHUNKS_BLOCK)
        emitted = tl.where(best_w_key > float("-inf"), best_w, best_p)
        tl.store(tokens_ptr + row * (num_drafts + 1) + tl.load(num_accepted_ptr + row), emitted.to(tl.int64))


def accept_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    in_thinking: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    relaxed_top_k: int = 0,
    relaxed_delta: float = 0.0,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The acceptance of `tandem.decoding.accept` for `rows` of the batch (module docstring).

    target_logits: [B, k+1, V] float32/bfloat16/float16, V >= 1
    draft_tokens:  [B, k] int64
    draft_probs:   [B, k, V] float or None (deterministic drafts)
    bitmask:       [B, k+1, ceil(V/32)] int32 or None
    in_thinking:   [B, k+1] bool where the relaxed rule applies, or None (relaxed acceptance off)
    temperature, seed: [B] float32 / int64, or None when every row is greedy
    min_p:         [B] float32, or None when no row has min-p
    relaxed_top_k, relaxed_delta: the relaxed rule's parameters (with `in_thinking`)
    rows:          [R] int64 row ids to compute, or None = every row; none may use top-k/top-p
    Returns (tokens [B, k+1] int64, num_accepted [B] int64, dead_end [B] bool), written for
    `rows` only. Inputs are checked by the caller and not modified.
    """
    batch, num_positions, vocab_size = target_logits.shape
    device = target_logits.device
    tokens = torch.empty(batch, num_positions, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    dead_end = torch.empty(batch, dtype=torch.int8, device=device)
    stochastic = temperature is not None
    num_kernel_rows = batch if rows is None else rows.numel()

    if num_kernel_rows:
        logits = _vocab_contiguous(target_logits)
        mask = None if bitmask is None else _vocab_contiguous(bitmask)
        q = None if draft_probs is None else _vocab_contiguous(draft_probs)
        drafts = draft_tokens.contiguous()
        thinking = None if in_thinking is None else in_thinking.contiguous().view(torch.uint8)
        dummy = logits  # stands in for absent optional tensors; never read (constexpr flags)
        has_min_p = min_p is not None
        # Without min-p the kernels load a row's min_p but never use it: any [B] float32 will do.
        temperature, min_p, seed = _or(temperature, dummy), _or(min_p, _or(temperature, dummy)), _or(seed, dummy)
        block = min(MAX_BLOCK, triton.next_power_of_2(vocab_size))
        num_chunks = triton.cdiv(vocab_size, block)
        # Per (row, position, chunk): max (min-p only), top, sum_t, sum_raw; argmax, ahead.
        stats = torch.empty(4, num_kernel_rows, num_positions, num_chunks, dtype=torch.float32, device=device)
        stat_ids = torch.empty(2, num_kernel_rows, num_positions, num_chunks, dtype=torch.int32, device=device)
        inputs = (logits, logits.stride(0), logits.stride(1), _or(mask, dummy), *_strides(mask, 2))
        row_ids = _or(rows, dummy)
        flags = dict(HAS_MASK=mask is not None, INDEXED=rows is not None)
        chunks_block = triton.next_power_of_2(num_chunks)
        grid = (num_kernel_rows, num_positions, num_chunks)  # rows on axis 0: CUDA caps axes 1 and 2 at 65,535
        warps = 8 if block >= 2048 else 4
        tiles = dict(BLOCK=block, ROW=min(32, block))
        if has_min_p:
            _chunk_max_kernel[grid](
                *inputs, row_ids, stats[0], num_chunks, vocab_size, **flags, **tiles, num_warps=warps
            )
        _chunk_stats_kernel[grid](
            *inputs,
            drafts,
            drafts.stride(0),
            temperature,
            min_p,
            seed,
            row_ids,
            stats[0],
            stats[1],
            stat_ids[0],
            stats[2],
            stats[3],
            stat_ids[1],
            num_positions - 1,
            num_chunks,
            vocab_size,
            **flags,
            STOCHASTIC=stochastic,
            HAS_MIN_P=has_min_p,
            RELAXED=thinking is not None,
            **tiles,
            CHUNKS_BLOCK=chunks_block,
            num_warps=warps,
        )
        _walk_kernel[(num_kernel_rows,)](
            *inputs,
            drafts,
            drafts.stride(0),
            _or(q, dummy),
            *_strides(q, 2),
            _or(thinking, dummy),
            *_strides(thinking, 1),
            temperature,
            min_p,
            seed,
            row_ids,
            stats[1],
            stat_ids[0],
            stats[2],
            stats[3],
            stat_ids[1],
            tokens,
            num_accepted,
            dead_end,
            num_positions - 1,
            num_chunks,
            vocab_size,
            relaxed_top_k,
            float(relaxed_delta),
            **flags,
            HAS_Q=q is not None,
            STOCHASTIC=stochastic,
            HAS_MIN_P=has_min_p,
            RELAXED=thinking is not None,
            CHUNKS_BLOCK=chunks_block,
            POSITIONS_BLOCK=triton.next_power_of_2(num_positions),
            num_warps=1,
        )
        if stochastic:  # per (row, chunk): the race's best keys and their ids, for w and for p
            race = torch.empty(2, num_kernel_rows, num_chunks, dtype=torch.float32, device=device)
            race_ids = torch.empty(2, num_kernel_rows, num_chunks, dtype=torch.int32, device=device)
            _race_kernel[(num_kernel_rows, num_chunks)](
                *inputs,
                drafts,
                drafts.stride(0),
                _or(q, dummy),
                *_strides(q, 2),
                temperature,
                min_p,
                seed,
                row_ids,
                stats[1],
                stat_ids[0],
                stats[2],
                num_accepted,
                dead_end,
                race[0],
                race_ids[0],
                race[1],
                race_ids[1],
                num_positions - 1,
                num_chunks,
                vocab_size,
                **flags,
                HAS_Q=q is not None,
                HAS_MIN_P=has_min_p,
                **tiles,
                CHUNKS_BLOCK=chunks_block,
                FAST_LOG=logits.is_cuda,
                num_warps=warps,
            )
            _race_finish_kernel[(num_kernel_rows,)](
                temperature,
                row_ids,
                num_accepted,
                dead_end,
                race[0],
                race_ids[0],
                race[1],
                race_ids[1],
                tokens,
                num_positions - 1,
                num_chunks,
                vocab_size,
                INDEXED=rows is not None,
                CHUNKS_BLOCK=chunks_block,
                num_warps=1,
            )
    return tokens, num_accepted, dead_end.view(torch.bool)


def _vocab_contiguous(value: torch.Tensor) -> torch.Tensor:
    """`value` with a unit stride in its last dim (copied only if needed)."""
    return value if value.stride(-1) == 1 else value.contiguous()


def _or(value: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if value is None else value


def _strides(value: torch.Tensor | None, count: int) -> tuple[int, ...]:
    return (0,) * count if value is None else tuple(value.stride()[:count])
