"""Speculative acceptance under grammar masks: greedy, lossless stochastic and relaxed.

One call verifies every row's k drafts against the target's k+1 distributions.
For row b and draft position j (0 <= j < k), with d_j the draft token:

- p_j is the target distribution (sampling.py): logits, grammar mask, temperature, top-k,
  top-p, min-p. A greedy row (temperature 0) has p_j = the point mass at the masked argmax.
- q_j is the draft distribution: `draft_probs[b, j]`, or the point mass at d_j when the draft
  is deterministic (`draft_probs=None`: EAGLE/MTP argmax drafts, n-gram).
- **Lossless rule** (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al. 2023): accept d_j with probability min(1, p_j(d_j) / q_j(d_j)). At
  the first rejection emit a sample of norm(max(p_j - q_j, 0)); if all k drafts are accepted,
  emit a bonus sample of p_k. Every emitted token is then distributed exactly as sampling from
  p. For a greedy row this reduces to: accept iff d_j == argmax p_j, emit the argmax.
- **Relaxed rule** (only where `in_thinking[b, j]` and `relaxed` is given; TensorRT-LLM's):
  also accept d_j when it ranks among the `relaxed.top_k` most likely tokens of
  r_j = softmax(masked logits) -- no temperature, no filters; ties ranked by lower id first --
  and r_j(d_j) >= max r_j - `relaxed.delta`. Otherwise the row's own rule decides, and its
  rejection emits what that rule emits. top_k=1, delta=0 is exactly greedy.
- **Padding**: a draft of PLACEHOLDER_TOKEN_ID (-1), or any id outside [0, V), is never
  accepted and its position emits a plain sample of p_j: rows with fewer than k drafts (a new
  row, an n-gram miss) pad with it and get exactly a plain sampling step there.
- **Masks**: a draft the grammar forbids is always rejected; every
  emitted token is allowed by its position's mask. A position whose mask allows nothing is a
  *dead end*: its draft is rejected, nothing is emitted there (`PLACEHOLDER_TOKEN_ID`) and the
  row's `dead_end` flag is set, so the engine can end the row with a clear reason.
- **Randomness**: counter-based per row (rng.py): the acceptance test of position j uses
  (seed, STREAM_ACCEPT, j), the emitted token (seed, STREAM_EMIT, 0). Same seed and inputs give
  the same tokens whatever else is in the batch.

The whole batch is processed with tensor ops (no Python loop over rows or positions); mixed
batches of greedy, stochastic, relaxed, masked and unmasked rows go through one call. One exception, on the
CPU: a batch of greedy rows without relaxed positions reads its masked argmaxes to the host and walks each
row's positions there (`_accept_greedy_host`); with no device to keep the work on, the tensor path's dozen
batch-wide ops cost more in dispatch than the walk of a few positions per row. `accept_argmax` walks the same
rule from argmaxes already chosen (graph mode chooses them inside the target's graph), on any device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from tandem.core.bitmask import bitmask_width, token_allowed
from tandem.core.checks import FLOAT_DTYPES, check_tensor
from tandem.core.rng import STREAM_ACCEPT, STREAM_EMIT, uniform
from tandem.decoding.params import RelaxedAcceptance, SamplingTensors
from tandem.decoding.sampling import (
    PLACEHOLDER_TOKEN_ID,
    argmax,
    check_sampling,
    greedy_tokens,
    mask_logits,
    sample_from_weights,
    target_probs,
)


@dataclass(frozen=True)
class AcceptanceResult:
    """What `accept` decided for each row.

    num_accepted: [B] int64 in 0..k, drafts accepted (a prefix of the row's drafts)
    tokens:       [B, k+1] int64, the accepted drafts, then the one recovered/bonus token,
                  then PLACEHOLDER_TOKEN_ID (-1)
    dead_end:     [B] bool, the row stopped at a position whose mask allows no token; then
                  tokens[b, num_accepted[b]] is PLACEHOLDER_TOKEN_ID and nothing was emitted there
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    dead_end: torch.Tensor
    host: list[tuple[list[int], int, bool]] | None = field(default=None, repr=False, compare=False)  # `to_host`'s
    carried: list[list[int]] | None = field(default=None, repr=False, compare=False)  # `read_with`'s other rows

    @classmethod
    def without_drafts(cls, tokens: torch.Tensor) -> AcceptanceResult:
        """The result of a step with k = 0 from `sample`'s tokens [B] (-1 at a dead end), which
        equal `accept`'s without drafts."""
        return cls(
            num_accepted=torch.zeros_like(tokens), tokens=tokens[:, None], dead_end=tokens == PLACEHOLDER_TOKEN_ID
        )

    @property
    def num_emitted(self) -> torch.Tensor:
        """[B] int64: tokens to commit per row (accepted drafts + the emitted token, if any)."""
        return self.num_accepted + (~self.dead_end).long()

    def to_host(self) -> list[tuple[list[int], int, bool]]:
        """Per row ``(emitted tokens, drafts accepted, dead end)`` as Python values: one read of the device (none
        when the result was decided on the host)."""
        if self.host is not None:
            return self.host
        return _host_rows(self._columns().tolist())

    def read_with(self, carry: torch.Tensor) -> AcceptanceResult:
        """This result with its host rows (`to_host`'s) and those of ``carry [B, n]`` int64 (`carried`), in one read
        of the device: a tensor launched after the acceptance (a lookahead proposal) comes back with it."""
        if self.host is not None:
            return replace(self, carried=carry.tolist())
        width = self.tokens.shape[1] + 2
        columns = torch.cat([self._columns(), carry], dim=1).tolist()
        return replace(self, host=_host_rows([c[:width] for c in columns]), carried=[c[width:] for c in columns])

    def _columns(self) -> torch.Tensor:
        """``[B, k+3]`` int64: each row's drafts accepted, dead end, tokens."""
        return torch.cat([self.num_accepted[:, None], self.dead_end[:, None].long(), self.tokens], dim=1)


def _host_rows(columns: list[list[int]]) -> list[tuple[list[int], int, bool]]:
    """`AcceptanceResult.to_host`'s rows of its `_columns` read to the host."""
    return [(tokens[: accepted + (not dead_end)], accepted, bool(dead_end)) for accepted, dead_end, *tokens in columns]


def accept(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    sampling: SamplingTensors | None = None,
    bitmask: torch.Tensor | None = None,
    in_thinking: torch.Tensor | None = None,
    relaxed: RelaxedAcceptance | None = None,
    backend: str = "auto",
) -> AcceptanceResult:
    """Verify drafts against the target (module docstring states the rules).

    target_logits: [B, k+1, V] float32/bfloat16/float16; position k is the bonus position
    draft_tokens:  [B, k] int64
    draft_probs:   [B, k, V] float, the draft distributions the drafts were sampled from,
                   or None for deterministic drafts (one-hot q)
    sampling:      per-row settings ([B]), or None = every row greedy
    bitmask:       [B, k+1, ceil(V/32)] int32, row j = tokens allowed after the first j drafts,
                   or None = no grammar
    in_thinking:   [B, k+1] bool, positions where relaxed acceptance may apply, or None = none
    relaxed:       the relaxed rule's parameters, or None = off
    backend:       "torch" (this function), "triton" (tandem.kernels, fused; same contract, greedy
                   and relaxed results identical, stochastic ones equal in distribution) or "auto"
                   (Triton for CUDA tensors when triton is installed; on the CPU the host walk for a
                   greedy batch without relaxed positions, identical results; torch otherwise)
    Does not modify its inputs.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    check_accept_inputs(target_logits, draft_tokens, draft_probs, sampling, bitmask, in_thinking, relaxed)
    if backend == "triton" or (backend == "auto" and target_logits.is_cuda and _triton_available()):
        return _accept_with_kernels(target_logits, draft_tokens, draft_probs, sampling, bitmask, in_thinking, relaxed)
    greedy = sampling is None or sampling.all_greedy
    if backend == "auto" and greedy and target_logits.is_cpu and (relaxed is None or in_thinking is None):
        return _accept_greedy_host(target_logits, draft_tokens, bitmask)
    return _accept_torch(target_logits, draft_tokens, draft_probs, sampling, bitmask, in_thinking, relaxed)


def _accept_with_kernels(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingTensors | None,
    bitmask: torch.Tensor | None,
    in_thinking: torch.Tensor | None,
    relaxed: RelaxedAcceptance | None,
) -> AcceptanceResult:
    """`accept` by the fused Triton kernels (`tandem.kernels.acceptance`); stochastic rows with
    top-k or top-p, which the kernels do not compute, by the torch path, row by row."""
    from tandem.kernels import accept_triton  # imported late: importing it compiles the kernels

    if target_logits.shape[-1] == 0:
        raise ValueError(
            f"target_logits must have a vocabulary of at least 1 token, got shape {list(target_logits.shape)}"
        )
    stochastic = sampling is not None and not sampling.all_greedy
    kernel_rows = torch_rows = None
    if stochastic and sampling.any_top_k_top_p:
        fallback = ((sampling.top_k > 0) | (sampling.top_p < 1)) & (sampling.temperature > 0)
        kernel_rows, torch_rows = (~fallback).nonzero().squeeze(-1), fallback.nonzero().squeeze(-1)
    tokens, num_accepted, dead_end = accept_triton(
        target_logits,
        draft_tokens,
        draft_probs=draft_probs,
        bitmask=bitmask,
        in_thinking=None if relaxed is None else in_thinking,
        temperature=sampling.temperature if stochastic else None,
        min_p=sampling.min_p if stochastic and sampling.any_min_p else None,
        seed=sampling.seed if stochastic else None,
        relaxed_top_k=0 if relaxed is None else relaxed.top_k,
        relaxed_delta=0.0 if relaxed is None else relaxed.delta,
        rows=kernel_rows,
    )
    result = AcceptanceResult(num_accepted=num_accepted, tokens=tokens, dead_end=dead_end)
    if torch_rows is not None and torch_rows.numel():
        pick = lambda value: None if value is None else value[torch_rows]  # noqa: E731
        torch_result = _accept_torch(
            target_logits[torch_rows],
            draft_tokens[torch_rows],
            pick(draft_probs),
            sampling.select(torch_rows),
            pick(bitmask),
            pick(in_thinking),
            relaxed,
        )
        result.num_accepted[torch_rows] = torch_result.num_accepted
        result.tokens[torch_rows] = torch_result.tokens
        result.dead_end[torch_rows] = torch_result.dead_end
    return result


def _accept_torch(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingTensors | None,
    bitmask: torch.Tensor | None,
    in_thinking: torch.Tensor | None,
    relaxed: RelaxedAcceptance | None,
) -> AcceptanceResult:
    """`accept` by torch ops on any device: the reference the kernels are tested against."""
    batch, num_positions, vocab_size = target_logits.shape
    k = num_positions - 1
    masked, dead = mask_logits(target_logits, bitmask)  # [B, k+1, V], [B, k+1]

    # A draft is eligible only if it is a real token, allowed by its mask, at a live position.
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab_size)
    drafts = draft_tokens.clamp(0, vocab_size - 1)  # [B, k], safe to index with
    eligible = in_vocab & ~dead[:, :k]
    if bitmask is not None:
        eligible &= token_allowed(bitmask[:, :k], drafts)

    if sampling is None or sampling.all_greedy:
        # Fast path, identical to the general one for greedy rows: p is a point mass.
        best = argmax(masked)  # [B, k+1]
        accepted = eligible & (drafts == best[:, :k])
        probs = None
    else:
        flat = masked.flatten(0, 1)
        probs = target_probs(flat, sampling.repeat_rows(num_positions)).view(batch, num_positions, vocab_size)
        p_draft = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, k]
        q_draft = 1.0 if draft_probs is None else draft_probs.float().gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        u = uniform(sampling.seed, STREAM_ACCEPT, torch.arange(k, device=drafts.device))  # [B, k]
        # u <= p/q without dividing; p > 0 so a q of 0 cannot accept a token p rules out.
        accepted = eligible & (p_draft > 0) & (u * q_draft <= p_draft)

    if relaxed is not None and in_thinking is not None:
        accepted |= eligible & in_thinking[:, :k] & _relaxed_accepts(masked[:, :k], drafts, relaxed)

    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B] length of the accepted prefix
    at_stop = num_accepted.view(batch, 1)
    if probs is None:
        emitted = best.gather(1, at_stop).squeeze(1)
    else:
        emitted = _emit(probs, draft_probs, drafts, in_vocab, at_stop, sampling.seed)
    dead_end = dead.gather(1, at_stop).squeeze(1)
    emitted = emitted.masked_fill(dead_end, PLACEHOLDER_TOKEN_ID)

    positions = torch.arange(num_positions, device=drafts.device)
    padded_drafts = torch.cat([drafts, drafts.new_full((batch, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    tokens = torch.where(positions < at_stop, padded_drafts, PLACEHOLDER_TOKEN_ID)
    tokens = torch.where(positions == at_stop, emitted.unsqueeze(1), tokens)
    return AcceptanceResult(num_accepted=num_accepted, tokens=tokens, dead_end=dead_end)


def _accept_greedy_host(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, bitmask: torch.Tensor | None
) -> AcceptanceResult:
    """`_accept_torch`'s greedy rule with each row's positions walked on the host, from its masked argmaxes: the same
    result. A draft equal to its position's masked argmax at a live position is a real token the mask allows, so that
    comparison alone is the rule's eligibility and acceptance."""
    best, dead = greedy_tokens(target_logits, bitmask)  # [B, k+1] each
    return _walk_greedy(best, draft_tokens, dead)


def accept_argmax(
    best: torch.Tensor, draft_tokens: torch.Tensor, carry: torch.Tensor | None = None
) -> AcceptanceResult:
    """`accept`'s greedy rule for positions without a mask, relaxed rule or adjusted logits whose argmaxes are
    known already (graph mode chooses them in the target's graph, `TargetOutput.greedy`): each row's drafts walked
    on the host, after one read of the device. No position is a dead end.

    best:         [B, k+1] int64, each position's argmax (below the vocabulary's real ids)
    draft_tokens: [B, k] int64
    carry:        [B, n] int64 or None, read in the same copy (`AcceptanceResult.carried`; `read_with`)
    """
    return _walk_greedy(best, draft_tokens, None, carry)


def accepted_counts(best: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """`accept_argmax`'s drafts accepted per row ``[B]`` int64, on the device, without reading it: the longest
    prefix of ``draft_tokens [B, k]`` equal to ``best [B, k+1]``'s argmaxes."""
    return (draft_tokens == best[:, :-1]).cumprod(dim=1).sum(dim=1)


def _walk_greedy(
    best: torch.Tensor, draft_tokens: torch.Tensor, dead: torch.Tensor | None, carry: torch.Tensor | None = None
) -> AcceptanceResult:
    """Each row's accepted prefix of ``draft_tokens [B, k]`` (equal to ``best [B, k+1]``'s argmaxes at live positions;
    ``dead [B, k+1]`` bool or None: none dead), read in one copy with ``carry [B, n]`` (None: nothing) and walked on
    the host; the result's tensors are the host's."""
    k = best.shape[1] - 1
    columns = [best, draft_tokens] if dead is None else [best, draft_tokens, dead.long()]
    read = torch.cat(columns if carry is None else [*columns, carry], dim=1).tolist()
    width = 2 * k + 1 + (dead is not None) * (k + 1)
    rows = []
    for row in read:
        top, drafts, ended = row[: k + 1], row[k + 1 : 2 * k + 1], row[2 * k + 1 : width] or [0] * (k + 1)
        n = 0
        while n < k and not ended[n] and drafts[n] == top[n]:
            n += 1
        rows.append((drafts[:n] if ended[n] else [*drafts[:n], top[n]], n, bool(ended[n])))
    tokens = [[*emitted, *[PLACEHOLDER_TOKEN_ID] * (k + 1 - len(emitted))] for emitted, _, _ in rows]
    return AcceptanceResult(
        num_accepted=torch.tensor([n for _, n, _ in rows], dtype=torch.int64),
        tokens=torch.tensor(tokens, dtype=torch.int64).view(len(rows), k + 1),
        dead_end=torch.tensor([ended for _, _, ended in rows], dtype=torch.bool),
        host=rows,
        carried=None if carry is None else [row[width:] for row in read],
    )


def _relaxed_accepts(masked: torch.Tensor, drafts: torch.Tensor, relaxed: RelaxedAcceptance) -> torch.Tensor:
    """The relaxed rule alone (eligibility is checked by the caller).

    masked: [B, k, V] float32 masked logits; drafts: [B, k] int64 -> [B, k] bool
    """
    probs = masked.softmax(dim=-1)
    p_draft = probs.gather(-1, drafts.unsqueeze(-1))  # [B, k, 1]
    ids = torch.arange(masked.shape[-1], device=drafts.device)
    ahead = (probs > p_draft) | ((probs == p_draft) & (ids < drafts.unsqueeze(-1)))
    rank = ahead.sum(dim=-1)  # tokens ranked before the draft, ties by lower id
    close = p_draft.squeeze(-1) >= probs.amax(dim=-1) - relaxed.delta
    return (rank < relaxed.top_k) & close


def _emit(
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    drafts: torch.Tensor,
    in_vocab: torch.Tensor,
    at_stop: torch.Tensor,
    seed: torch.Tensor,
) -> torch.Tensor:
    """The token emitted at each row's stop position n: a sample of norm(max(p_n - q_n, 0))
    if n < k (rejection), of p_k if n == k (bonus).

    probs: [B, k+1, V]; draft_probs: [B, k, V] or None; drafts, in_vocab: [B, k];
    at_stop: [B, 1] int64 = n; seed: [B] int64  ->  [B] int64
    """
    batch, num_positions, vocab_size = probs.shape
    k = num_positions - 1
    rejected = at_stop < k  # [B, 1]; False: the bonus position, where q is 0
    draft_pos = at_stop.clamp(max=max(k - 1, 0))
    p = probs.gather(1, at_stop.unsqueeze(-1).expand(batch, 1, vocab_size)).squeeze(1)  # [B, V]
    if k == 0:
        residual = p
    elif draft_probs is None:
        # q is one-hot at the draft: max(p - q, 0) is p with the draft's entry zeroed.
        drafted = drafts.gather(1, draft_pos)
        zero_it = rejected & in_vocab.gather(1, draft_pos)
        residual = p.scatter(-1, drafted, torch.where(zero_it, 0.0, p.gather(-1, drafted)))
    else:
        q = draft_probs.float().gather(1, draft_pos.unsqueeze(-1).expand(batch, 1, vocab_size)).squeeze(1)
        # Only a real draft was sampled from q: a padded position (-1) is a plain sample of p.
        drafted = rejected & in_vocab.gather(1, draft_pos)
        residual = (p - q * drafted).clamp_(min=0.0)
    # p == q leaves no residual mass; rejection then had probability 0, so any p-sample is right.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    u = uniform(seed, STREAM_EMIT, torch.zeros(1, dtype=torch.int64, device=seed.device)).squeeze(1)
    return sample_from_weights(residual, u)


def check_accept_inputs(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingTensors | None,
    bitmask: torch.Tensor | None,
    in_thinking: torch.Tensor | None,
    relaxed: RelaxedAcceptance | None,
) -> None:
    check_tensor("target_logits", target_logits, (None, None, None), FLOAT_DTYPES)
    batch, num_positions, vocab_size = target_logits.shape
    if num_positions < 1:
        raise ValueError("target_logits must have k+1 >= 1 positions, got 0")
    if vocab_size < 1:
        raise ValueError("target_logits must have a vocabulary of V >= 1 tokens, got 0")
    k = num_positions - 1
    device = target_logits.device
    check_tensor("draft_tokens", draft_tokens, (batch, k), (torch.int64,), device)
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, (batch, k, vocab_size), FLOAT_DTYPES, device)
    if bitmask is not None:
        check_tensor("bitmask", bitmask, (batch, num_positions, bitmask_width(vocab_size)), (torch.int32,), device)
    if in_thinking is not None:
        check_tensor("in_thinking", in_thinking, (batch, num_positions), (torch.bool,), device)
    if relaxed is not None and not isinstance(relaxed, RelaxedAcceptance):
        raise ValueError(f"relaxed must be a RelaxedAcceptance or None, got {type(relaxed).__name__}")
    check_sampling(sampling, batch, device)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
