"""n-gram (prompt lookup) draft: model-free proposals copied from earlier in the same sequence.

For each row, the longest suffix of its committed tokens (``max_ngram`` down to ``min_ngram``
tokens) that also occurs earlier in the sequence is looked up; the draft is the ``k`` tokens
that followed its most recent earlier occurrence. Rows without a match, or with fewer than
``k`` tokens after the match, are padded with ``PLACEHOLDER_TOKEN_ID`` (-1). Drafts are
deterministic (``probs`` is None): excellent on JSON and agent traces, where keys and tool
calls repeat, and the baseline every model draft must beat.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.core.transfer import to_device
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID
from tandem.models.base import BlockTable, Draft, DraftInput, DraftProposal, KVCache
from tandem.models.config import NgramConfig


def lookup(history: Tensor, num_tokens: int, min_ngram: int, max_ngram: int) -> Tensor:
    """Prompt lookup over one row: ``history: [L] int64`` -> ``[num_tokens] int64`` (-1 padded).

    A byte search over the ids' buffer (one C call per n-gram size, where comparing every window as a tensor took
    a dozen small ops per size); a hit counts only where it falls on an id's boundary."""
    out = torch.full((num_tokens,), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    history = history.cpu()
    data, size = history.numpy().tobytes(), history.element_size()
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = data[-n * size :]
        at = data.rfind(suffix, 0, len(data) - size)  # an occurrence ending before the suffix's last id
        while at > 0 and at % size:  # inside an id: search again, starting before it
            at = data.rfind(suffix, 0, at + len(suffix) - 1)
        if at >= 0:
            start = at // size + n  # the most recent occurrence's end
            follow = history[start : start + num_tokens]
            out[: len(follow)] = follow
            return out
    return out


class NgramDraft(Draft):
    """Implements :class:`tandem.models.base.Draft` without a model: needs ``DraftInput.history``."""

    hidden_kind = None
    follows_constraint = False  # it copies tokens from the history; the verify masks judge them

    def __init__(self, min_ngram: int = 2, max_ngram: int = 5):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> None:
        return None

    def propose(self, inp: DraftInput, cache: KVCache | None, num_tokens: int) -> DraftProposal:
        """``tokens: [B, num_tokens]`` on the batch's device; ``probs`` None (deterministic)."""
        if inp.history is None:
            raise ValueError("the n-gram draft needs DraftInput.history (every row's committed token ids)")
        rows = [lookup(h, num_tokens, self.min_ngram, self.max_ngram) for h in inp.history]
        tokens = torch.stack(rows) if rows else torch.empty(0, num_tokens, dtype=torch.int64)
        return DraftProposal(tokens=to_device(tokens, inp.batch.input_ids.device), probs=None)


def build(config: NgramConfig, weights: None, *, dtype: torch.dtype, device: torch.device, target=None) -> NgramDraft:
    """The loading registry's builder for ``"ngram"``."""
    return NgramDraft(config.min_ngram, config.max_ngram)
