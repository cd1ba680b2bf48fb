"""Training-time test (TTT, EAGLE-3 paper, section 3.2): a draft head trained as it is chained.

A draft turns the pair (target state at p-1, token x_p) into a prediction of x_{p+1} and is chained
k times at inference (:func:`tandem.models.drafts.chained.propose_chained`). TTT trains ``depths``
chained depths at once: depth 0 reads the target's features, depth d reads the draft's own output
of depth d-1 at the previous position, and every depth attends to exactly what it attends to at
inference (:func:`ttt_visibility`). The loss is the cross-entropy against the frozen target's
distribution at the same position (distillation: acceptance is agreement with the target, not
with the data), weighted by ``decay ** d``, on the assistant turn only (:func:`ttt_loss`).

Pair i of a row stands for position p = i + 1: its inputs are the target's features at i and the
token at i + 1, its teacher is the target's distribution at i + 1. A target pass
(:func:`provider_pass` for tandem's providers) gives the features, embeddings and teacher logits;
:func:`ttt_log_probs` chains the head over them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from tandem.models.base import ForwardBatch, Target
from tandem.training.data import IGNORE_INDEX
from tandem.training.heads import DraftHead, TargetHead
from tandem.training.vocab import DraftVocab

DEPTHS = 4  # chained draft steps trained: the k the demo drafts run with
DEPTH_DECAY = 0.8  # loss weight of depth d is DEPTH_DECAY ** d (EAGLE-3's choice)


@dataclass
class TargetPass:
    """What the frozen target gives a batch of P pairs per row."""

    features: Tensor  # [B, P, Hf]: what the head reads at depth 0 (aux hidden states or the last hidden)
    embeds: Tensor  # [B, P, H]: the target's embeddings of the pairs' tokens x_{i+1}
    teacher: Tensor  # [N, V] float32: the target's logits at i + 1 of the N scored pairs (row-major)


def scored_pairs(labels: Tensor) -> Tensor:
    """``labels [B, T]`` (IGNORE_INDEX outside the assistant turn) -> ``[B, T - 1]`` bool: pair i is scored
    when its teacher predicts an assistant token, x_{i+2}."""
    return F.pad(labels[:, 2:] != IGNORE_INDEX, (0, 1), value=False)


def ttt_visibility(num_pairs: int, depth: int) -> Tensor:
    """Which keys the depth-``depth`` queries see among the keys of depths 0..depth, concatenated.

    Returns [P, (depth+1) * P] bool, blocks of P keys per depth. A depth-d query at pair i stands for
    the d-th chained step after the first i-d+1 pairs were committed: it sees the depth-0 keys of
    pairs 0..i-d and, for 1 <= j <= d, the depth-j key of pair i-d+j (the chained steps before it and
    itself).
    """
    i = torch.arange(num_pairs)
    query, key = i[:, None], i[None, :]
    blocks = [key <= query - depth] + [(key == query - depth + j) for j in range(1, depth + 1)]
    return torch.cat(blocks, dim=1)


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """[Q, K] bool -> [1, 1, Q, K] additive attention mask (0 where visible)."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def ttt_log_probs(
    head: DraftHead, target: TargetHead, embeds: Tensor, features: Tensor, depths: int, where: Tensor | None = None
) -> list[Tensor]:
    """The draft's next-token log-probs per depth 0..depths-1: ``[B, P, draft_V]`` float32, or ``[N, draft_V]``
    at the pairs ``where [B, P]`` bool selects (the head's logits cost nothing elsewhere).

    ``embeds [B, P, H]``, ``features [B, P, Hf]``: a :class:`TargetPass`'s (right-padded rows: a padded
    pair is never seen by a real one). A depth-d entry is meaningful for pairs i >= d. Each depth runs
    the head once over its P pairs; its keys and values join a cache that the later depths read, as
    the chained steps of inference read the draft's KV cache.
    """
    hidden = head.features(features.to(embeds.dtype))
    num_rows, num_pairs = embeds.shape[:2]
    positions = torch.arange(1, num_pairs + 1, device=embeds.device).expand(num_rows, num_pairs)
    rope = head.rotary(embeds, positions)
    cache, draft = DynamicCache(), []
    for depth in range(depths):
        mask = _additive(ttt_visibility(num_pairs, depth), hidden.dtype).to(embeds.device)
        g = head.layer(embeds, hidden, rope, mask, cache)
        draft.append(head.logits(g if where is None else g[where], target).float().log_softmax(-1))
        hidden = F.pad(g[:, :-1], (0, 0, 1, 0))  # depth d+1 at pair i reads g at pair i-1
    return draft


def ttt_loss(
    draft: list[Tensor], teacher: Tensor, pairs: Tensor, vocab: DraftVocab | None = None, decay: float = DEPTH_DECAY
) -> tuple[Tensor, list[float]]:
    """The TTT distillation loss over N scored pairs, and the top-1 agreement with the target per depth.

    draft: per depth ``[N, draft_V]`` log-probs (:func:`ttt_log_probs` at the scored pairs); teacher:
    ``[N, V]`` logits; pairs: ``[N]`` int64, each entry's pair index (depth d scores pairs i >= d). With
    a reduced ``vocab`` the teacher is the target's distribution renormalised over the draft's tokens,
    and entries whose target top-1 has no draft id carry no loss (SpecForge's rule); agreement counts
    every entry, those included (a draft cannot propose what it cannot name), so it is the acceptance
    rate a greedy verify would see.
    """
    top = teacher.argmax(-1)  # [N]: the target's greedy token
    if vocab is not None:
        top = vocab.draft_ids().to(top.device)[top]  # -1: outside the draft vocabulary
        teacher = teacher[..., vocab.token_ids.to(teacher.device)]
    teacher = teacher.float().log_softmax(-1).exp()
    loss, agreement = teacher.new_zeros(()), []
    for depth, log_probs in enumerate(draft):
        valid = pairs >= depth
        trained = valid & (top >= 0)
        if trained.any():
            loss = loss + decay**depth * (-(teacher * log_probs).sum(-1))[trained].mean()
        agreement.append((log_probs.argmax(-1) == top)[valid].float().mean().item() if valid.any() else 0.0)
    return loss, agreement


@torch.no_grad()
def provider_pass(
    target: Target, hidden_kind: str, input_ids: Tensor, attention_mask: Tensor, where: Tensor
) -> TargetPass:
    """The frozen target's :class:`TargetPass` through tandem's own provider (``Target.forward``).

    input_ids, attention_mask: ``[B, T]``, right-padded; where: ``[B, T - 1]`` bool, the scored pairs
    (:func:`scored_pairs`), the only positions whose logits are computed. The rows run as one ragged
    batch, each in its own cache slot; ``hidden_kind`` "aux" reads ``aux_hidden`` (EAGLE-3), "last"
    ``hidden`` (EAGLE-1). Padded pairs repeat the row's last token's values (never scored, never seen
    by a real pair).
    """
    lengths = attention_mask.sum(1).tolist()
    rows = [ids[:n].tolist() for ids, n in zip(input_ids, lengths)]
    device = next(target.parameters()).device
    width = input_ids.shape[1]
    starts = [0, *itertools.accumulate(lengths)][:-1]
    grid = torch.tensor([[start + min(t, n - 1) for t in range(width)] for start, n in zip(starts, lengths)])
    scored = grid[:, 1:][where.cpu()].tolist()  # token index of each scored pair's teacher, i + 1
    batch = ForwardBatch.from_rows(rows, [0] * len(rows), list(range(len(rows))), logits_indices=scored, device=device)
    cache = target.new_cache(len(rows), width)
    out = target.forward(batch, cache, return_hidden=hidden_kind == "last", return_aux=hidden_kind == "aux")
    features = (out.aux_hidden if hidden_kind == "aux" else out.hidden)[grid.to(device)]  # [B, T, Hf]
    return TargetPass(
        features=features[:, :-1].float(),
        embeds=target.embed(input_ids[:, 1:].to(device)).float(),
        teacher=out.logits,
    )
