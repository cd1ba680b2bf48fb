"""The chained proposal that EAGLE, EAGLE-3 and MTP share: one step over the committed tokens,
then ``k - 1`` single-token steps, each reading the previous step's output; and a worker rank's part of one
(:func:`follow_chained`) when the draft's steps run over several ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tandem.decoding.sampling import argmax, forbid_ids_from
from tandem.models.base import DraftInput, ForwardBatch, KVCache, Target
from tandem.models.config import LlamaConfig

StepFn = Callable[[ForwardBatch, Tensor, KVCache], Tensor]  # (batch, hidden [T, *], cache) -> hidden [T, H]
HeadFn = Callable[[Tensor], Tensor]  # hidden [B, H] -> logits [B, V] over the target vocabulary
ReceiveFn = Callable[[int], Tensor]  # B -> the [B] int64 tokens the driver chose at a chained position


def check_pair(config: LlamaConfig, target: Target, what: str) -> None:
    """Raise ``ValueError`` when a draft config's hidden size does not fit ``target``."""
    if config.hidden_size != target.hidden_size:
        raise ValueError(
            f"{what} draft hidden_size {config.hidden_size} does not match the target's {target.hidden_size}"
        )


def propose_chained(step: StepFn, head: HeadFn, inp: DraftInput, hidden: Tensor, cache: KVCache, k: int) -> Tensor:
    """Run ``step`` over the committed tokens, then chain ``k - 1`` single-token steps.

    ``hidden [T, *]`` is what ``step`` reads for the committed tokens; chained steps read the
    previous step's output at each row's last token, at the next position. Each token is the
    argmax of ``head``'s logits after ``inp.adjust`` (penalties), below ``inp.vocab_limit``, among the tokens
    ``inp.constraint`` allows (lowest id among ties). Returns ``[B, k]`` int64. Without constraint and
    adjustments, ``inp.chain`` (graph mode) runs it all where it can, over the draft's ``target_logits``, which
    ``head`` must be.
    """
    batch = inp.batch
    if inp.chain is not None and inp.constraint is None and inp.adjust is None:
        tokens = inp.chain(batch, hidden, cache, k, inp.vocab_limit)
        if tokens is not None:
            return tokens
    h = step(batch, hidden, cache)[batch.last_token_indices()]
    tokens = batch.input_ids.new_empty(batch.num_rows, k)
    constraint = inp.constraint
    for i in range(k):
        logits = head(h)
        if inp.adjust is not None:
            logits = inp.adjust(logits, tokens[:, :i])
        forbid_ids_from(logits, inp.vocab_limit)
        if constraint is not None:
            logits = torch.where(constraint.allowed(), logits, float("-inf"))
        tokens[:, i] = argmax(logits)
        if constraint is not None:
            constraint.advance(tokens[:, i])
        if i + 1 < k:
            batch = batch.following(tokens[:, i])
            h = step(batch, h, cache)
    return tokens


def follow_chained(
    step: StepFn, batch: ForwardBatch, hidden: Tensor, cache: KVCache, k: int, receive: ReceiveFn
) -> None:
    """A worker rank's part of a :func:`propose_chained` that the driver runs over several ranks: the same ``k``
    steps into this rank's ``cache`` (their collectives meet the driver's), each chained position's tokens taken
    from ``receive``: the driver alone reads the head and chooses them (under the grammar, with penalties)."""
    h = step(batch, hidden, cache)[batch.last_token_indices()]
    for _ in range(k - 1):
        batch = batch.following(receive(batch.num_rows))
        h = step(batch, h, cache)
