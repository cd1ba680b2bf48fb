"""The target distribution of one position, and plain (non-speculative) sampling from it.

The target distribution at a position is the model's logits, then the grammar mask (forbidden
tokens get -inf), then temperature, top-k, top-p and min-p, in that order:

- temperature 0: the point mass at the masked argmax (lowest id among ties); filters are moot.
- top-k (0 = off): keep tokens whose logit is >= the k-th largest (ties at the boundary kept).
- top-p (1 = off): keep the smallest most-likely-first prefix (stable order, lowest id first
  among ties) whose probability, renormalised after top-k, reaches top_p.
- min-p (0 = off): keep tokens with p >= min_p * p(top1).

Every filter keeps the top token, so a position has an empty support only when its mask
allows no token (or every allowed logit is -inf): a *dead end*. Dead ends emit
`PLACEHOLDER_TOKEN_ID` instead of a token; the engine ends such a row.

`accept` (acceptance.py) uses exactly these functions; `sample` is the k = 0 case.
"""

from __future__ import annotations

import torch

from tandem.core.bitmask import bitmask_width, unpack_bitmask
from tandem.core.checks import FLOAT_DTYPES, check_tensor
from tandem.core.rng import STREAM_EMIT, uniform
from tandem.decoding.params import SamplingTensors

PLACEHOLDER_TOKEN_ID = -1  # no token: past the emitted one, or at a dead end


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits [..., V] -> [...]`` int64, the first index of each row's maximum (as ``torch.argmax``). CPU float32
    rows outside ``torch.compile`` go through numpy: torch's CPU argmax is a scalar loop, numpy's vectorized, and
    greedy decoding takes one per step (a plain step, each draft pass, every verified position)."""
    if logits.is_cpu and logits.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def forbid_ids_from(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """``logits [..., V]`` with the ids from ``vocab_limit`` up at -inf, in place (a model's embedding rows past its
    tokenizer's: never emitted nor drafted); nothing when ``vocab_limit`` is None or V fits below it."""
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits[..., vocab_limit:] = float("-inf")
    return logits


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a grammar bitmask; find dead ends.

    logits:  [..., V] float (any float dtype; computed in float32)
    bitmask: [..., W] int32 or None (all allowed)
    returns: masked [..., V] float32 with forbidden tokens at -inf, except that dead-end
             rows are all zeros (so later math stays finite; their output is discarded);
             dead [...] bool, True where no token is allowed.
    """
    masked = apply_mask(logits, bitmask)
    dead = masked.amax(dim=-1) == float("-inf")
    return masked.masked_fill(dead.unsqueeze(-1), 0.0), dead


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """``logits [..., V]`` in float32 with the tokens ``bitmask [..., W]`` forbids at -inf (None: all allowed)."""
    if bitmask is None:
        return logits.float()
    # where(allowed, ...), not masked_fill(~allowed, ...): one op fewer, which shows in accept's time under a mask
    return torch.where(unpack_bitmask(bitmask, logits.shape[-1]), logits.float(), float("-inf"))


def greedy_tokens(logits: torch.Tensor, bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's masked argmax ``[...]`` int64 of ``logits [..., V]`` under ``bitmask [..., W]`` (None: all
    allowed), and ``[...]`` bool whether the row allows nothing (its maximum is -inf)."""
    masked = apply_mask(logits, bitmask)
    tokens = argmax(masked)
    return tokens, masked.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) == float("-inf")


def target_probs(masked: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """The target distribution p of each row (module docstring), from masked logits.

    masked:   [N, V] float32, from `mask_logits`
    sampling: per-row settings with batch size N
    returns:  [N, V] float32, rows sum to 1; greedy rows are one-hot at the argmax
    """
    greedy = sampling.temperature == 0
    logits = masked / torch.where(greedy, 1.0, sampling.temperature).unsqueeze(-1)
    if sampling.any_top_k_top_p:
        logits = _top_k_top_p(logits, sampling.top_k, sampling.top_p, sampling.max_top_k)
    if sampling.any_min_p:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); min_p = 0 keeps all.
        threshold = logits.amax(dim=-1, keepdim=True) + sampling.min_p.log().unsqueeze(-1)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = logits.softmax(dim=-1)
    if sampling.any_greedy:
        point_mass = torch.zeros_like(probs).scatter_(-1, masked.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), point_mass, probs)
    return probs


# Top-k/top-p look at this many most likely tokens per row instead of sorting the whole
# vocabulary; rows whose cut the candidates cannot decide exactly fall back to a full sort.
TOP_P_CANDIDATES = 1024


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k then top-p with per-row k and p.

    logits: [N, V] float32; top_k: [N] int64 (0 = off); top_p: [N] float32 (1 = off);
    max_top_k: the largest top_k in the batch  ->  [N, V] with removed tokens at -inf
    """
    vocab_size = logits.shape[-1]
    num_candidates = min(vocab_size, max(TOP_P_CANDIDATES, max_top_k))
    values, ids = sorted_candidates(logits, num_candidates)  # [N, C], most likely first
    kth = values.gather(-1, (top_k.clamp(1, num_candidates) - 1).unsqueeze(-1))
    kth = kth.masked_fill((top_k == 0).unsqueeze(-1), float("-inf"))  # [N, 1], top-k's threshold
    logits = logits.masked_fill(logits < kth, float("-inf"))

    # Top-p over the candidates, normalised over the whole (top-k filtered) row.
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp().masked_fill(values < kth, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = (mass_before < top_p.unsqueeze(-1)) | (top_p >= 1).unsqueeze(-1)
    last_kept = values.gather(-1, keep.sum(dim=-1, keepdim=True) - 1).squeeze(-1)
    # Exact when the cut falls strictly above the least likely candidate: every token before
    # the cut is then a candidate, in the right order.
    decided = (
        (top_p >= 1)
        | (num_candidates == vocab_size)
        | ((mass_before[:, -1] + probs[:, -1] >= top_p) & (last_kept > values[:, -1]))
    )
    remove = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, ids, ~keep)
    remove &= (decided & (top_p < 1)).unsqueeze(-1)
    logits = logits.masked_fill(remove, float("-inf"))
    undecided = (~decided).nonzero().squeeze(-1)
    if undecided.numel():
        full_values, full_ids = sorted_candidates(logits[undecided], vocab_size)
        full_probs = full_values.softmax(dim=-1)
        full_keep = (full_probs.cumsum(dim=-1) - full_probs) < top_p[undecided].unsqueeze(-1)
        full_remove = torch.empty_like(full_keep).scatter_(-1, full_ids, ~full_keep)
        logits[undecided] = logits[undecided].masked_fill(full_remove, float("-inf"))
    return logits


def sorted_candidates(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest logits per row, ordered by value descending, then id ascending.

    logits: [N, V]  ->  values [N, count] float32, ids [N, count] int64
    """
    if count == logits.shape[-1]:
        return logits.sort(dim=-1, descending=True, stable=True)  # stable: ids ascending among ties
    values, ids = logits.topk(count, dim=-1)
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(-1, by_value), ids.gather(-1, by_value)


def check_sampling(sampling: SamplingTensors | None, batch: int, device: torch.device) -> None:
    """Raise ValueError unless `sampling` is None or has `batch` rows on `device`."""
    if sampling is None:
        return
    if not isinstance(sampling, SamplingTensors):
        raise ValueError(f"sampling must be a SamplingTensors or None, got {type(sampling).__name__}")
    if sampling.batch_size != batch:
        raise ValueError(f"sampling has {sampling.batch_size} rows, the logits have {batch}")
    if sampling.device != device:
        raise ValueError(f"sampling is on {sampling.device}, expected {device} like the logits")


def sample_from_weights(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row, with probability proportional to its weight.

    weights: [N, V] non-negative float, each row with positive total
    u:       [N] float in (0, 1]
    returns: [N] int64. A token of weight 0 is never returned: the first index whose
             running sum reaches u * total > 0 must have added a positive weight.
    """
    cdf = weights.double().cumsum(dim=-1)
    target = u.double() * cdf[:, -1]
    return torch.searchsorted(cdf, target.unsqueeze(-1)).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def sample(
    logits: torch.Tensor,
    sampling: SamplingTensors | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row from the target distribution (module docstring).

    logits:   [B, V] float32/bfloat16/float16
    sampling: per-row settings, or None = every row greedy
    bitmask:  [B, ceil(V/32)] int32 (1 = allowed), or None = no grammar
    returns:  [B] int64; PLACEHOLDER_TOKEN_ID (-1) for a row whose mask allows nothing.
    Draws use the row's seed on stream STREAM_EMIT, counter 0, exactly as `accept` does for the
    token it emits, so `sample(logits)` equals `accept(logits[:, None], <no drafts>)` token for token.
    """
    check_tensor("logits", logits, (None, None), FLOAT_DTYPES)
    batch, vocab_size = logits.shape
    if bitmask is not None:
        check_tensor("bitmask", bitmask, (batch, bitmask_width(vocab_size)), (torch.int32,), logits.device)
    check_sampling(sampling, batch, logits.device)
    if sampling is None or sampling.all_greedy:
        tokens, dead = greedy_tokens(logits, bitmask)
    else:
        masked, dead = mask_logits(logits, bitmask)
        u = uniform(sampling.seed, STREAM_EMIT, torch.zeros(1, dtype=torch.int64, device=logits.device))
        tokens = sample_from_weights(target_probs(masked, sampling), u.squeeze(-1))
    return tokens.masked_fill(dead, PLACEHOLDER_TOKEN_ID)
