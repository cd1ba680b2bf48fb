"""Log-probabilities of generated tokens, as `SamplingParams.logprobs` asks for them.

They are the target model's own: a log-softmax of its raw logits at the position that emitted
the token, before the grammar mask, penalties, logit bias and the sampling settings (vLLM's
default, "raw logprobs"). A speculative step reads them from the verify pass, so they equal the
plain path's up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.transfer import int64_tensor
from tandem.decoding.sampling import sorted_candidates


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first (ties: lower id first)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """logits [n, V] (any float dtype) of the positions that emitted token_ids [n]; num_top >= 0."""
    log_probs = logits.float().log_softmax(dim=-1)
    chosen = log_probs.gather(-1, int64_tensor(token_ids, logits.device).unsqueeze(-1)).squeeze(-1).tolist()
    if num_top == 0:
        return [TokenLogprob(token, logprob, []) for token, logprob in zip(token_ids, chosen)]
    values, ids = sorted_candidates(log_probs, min(num_top, log_probs.shape[-1]))
    values, ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(token, logprob, list(zip(top_ids, top_values)))
        for token, logprob, top_ids, top_values in zip(token_ids, chosen, ids, values)
    ]
