"""The reference a TTT depth must equal: the loaded draft chained step by step over the true tokens."""

from __future__ import annotations

import torch

from tandem.models.base import ForwardBatch


def chained_log_probs(draft, ids: list[int], first: torch.Tensor, depth: int, pair: int) -> torch.Tensor:
    """The loaded ``draft``'s log-probabilities ``[V_draft]`` for pair ``pair`` (hidden at position ``pair``, token
    at ``pair + 1``) at TTT depth ``depth``: a fresh cache holds the committed pairs before it, from ``first``
    (``[T, H]``, the depth-0 hidden state at each position), then ``depth`` chained steps over the true tokens."""
    committed = pair - depth + 1  # pairs 0..committed-1 sit at positions 1..committed
    cache = draft.new_cache(1, 64)
    g = draft.step(ForwardBatch.from_rows([ids[1 : committed + 1]], [1], [0]), first[:committed], cache)[-1:]
    for position in range(committed + 1, committed + depth + 1):
        g = draft.step(ForwardBatch.from_rows([[ids[position]]], [position], [0]), g, cache)
    return draft.logits(g).float().log_softmax(-1)[0]
