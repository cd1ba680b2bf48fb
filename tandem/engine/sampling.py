"""What acceptance (step 4) needs from the rows besides the logits: their penalties and logit biases,
their sampling settings with this step's seeds, and their drafts' probabilities.

Each part is None when no row asks for it, so a step of greedy, unpenalised rows with deterministic
drafts builds nothing here. The draft, when it follows the rows' constraints, proposes under the
same adjustments (step 6).
"""

from __future__ import annotations

import torch

from tandem.core.rng import derive_seeds
from tandem.core.transfer import Staging
from tandem.decoding.params import SamplingTensors, batch_sampling
from tandem.decoding.penalties import LogitAdjustments
from tandem.engine.request import Request


def adjustments(
    rows: list[Request], vocab_size: int, device: torch.device, staging: Staging | None = None
) -> LogitAdjustments | None:
    """The rows' penalties and logit biases over their committed output (`decoding.penalties`), sent in one copy
    or in ``staging``'s; None when no row asks for any (such steps pay nothing)."""
    if not any(r.params.adjusts_logits for r in rows):
        return None
    return LogitAdjustments.build(
        [r.params for r in rows],
        [r.prompt for r in rows],
        [r.tokens[len(r.prompt) :] for r in rows],
        vocab_size,
        device,
        staging,
    )


def sampling_tensors(
    rows: list[Request], device: torch.device, staging: Staging | None = None
) -> SamplingTensors | None:
    """This step's per-row settings, sent in one copy per field or in ``staging``'s, or None when every row is
    greedy (no seeds needed). A row's seed for the step follows from its own seed and its length, whatever else
    is in the batch."""
    if all(r.params.temperature == 0 for r in rows):
        return None
    seeds = derive_seeds(torch.tensor([r.seed for r in rows]), torch.tensor([r.num_generated for r in rows]))
    return batch_sampling([r.params for r in rows], seeds, device, staging)


def draft_probs(rows: list[Request], k: int, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """The drafts' distributions [B, k, V] (zero past a row's drafts), or None when every row's draft
    is deterministic."""
    if all(r.draft_probs is None for r in rows):
        return None
    probs = torch.zeros(len(rows), k, vocab_size, device=device)
    for b, r in enumerate(rows):
        if r.draft_probs is not None:
            probs[b, : len(r.drafts)] = r.draft_probs
    return probs
