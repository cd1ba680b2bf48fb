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
    chosen, values, ids = logprob_tensors(logits, int64_tensor(token_ids, logits.device), num_top)
    return assemble(token_ids, chosen.tolist(), values.tolist(), ids.tolist())


def logprob_tensors(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`token_logprobs` reads, left on the device: logits [n, V], token_ids [n] int64 (a negative id reads
    any: a dead end's placeholder) -> (chosen [n] float32, top values [n, num_top] float32, top ids [n, num_top])."""
    log_probs = logits.float().log_softmax(dim=-1)
    chosen = log_probs.gather(-1, token_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    if num_top == 0:
        return chosen, log_probs.new_empty(len(chosen), 0), token_ids.new_empty(len(chosen), 0)
    return chosen, *sorted_candidates(log_probs, min(num_top, log_probs.shape[-1]))


def assemble(
    token_ids: list[int], chosen: list[float], values: list[list[float]], ids: list[list[int]]
) -> list[TokenLogprob]:
    """:func:`logprob_tensors`'s values, read back, as each token's :class:`TokenLogprob`."""
    return [
        TokenLogprob(token, logprob, list(zip(top_ids, top_values)))
        for token, logprob, top_ids, top_values in zip(token_ids, chosen, ids, values)
    ]
