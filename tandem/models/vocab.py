"""The vocabulary's matrices, split over tensor-parallel ranks: :class:`VocabParallelEmbedding` and
:class:`ParallelLMHead` (Megatron's vocabulary-parallel layers, as vLLM's).

Each rank owns the ids ``shard.part(vocab_size)`` and computes with those rows only: the embedding looks up the
ids in its range (zeros for the others) and all-reduces, so every rank gets every token's row; the head scores
its ids and all-gathers, so every rank gets the full ``[N, V]`` logits one device would give.

Rank 0 holds the whole matrix and its piece is a view of it: Llama's drafts (EAGLE, EAGLE-3) run on rank 0
alone and call the target's full-vocabulary ``embed`` / ``lm_head`` (:meth:`~VocabParallelEmbedding.embed_whole`,
:meth:`~VocabParallelEmbedding.logits_whole`: no collective inside, and no other rank calls them). The other ranks
read and keep only their rows (``checkpoint_parts``). On one device both are the plain ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.models.layers import Layer
from tandem.models.linear import linear
from tandem.models.loading import Part
from tandem.models.parallel import SINGLE, Shard


class VocabParallelEmbedding(Layer):
    """Token embeddings ``ids: [T] int64 -> [T, H]``, this rank computing the rows of its ids.

    ``weight``: ``[V, H]`` on rank 0, ``[V / size, H]`` (the rank's ids) elsewhere; ValueError naming the
    vocabulary when the size does not divide it. ``tied``: the matrix is the LM head too (:meth:`logits`), read
    by :func:`~tandem.models.linear.linear`, so it may be stored narrower like a head's: its rows are widened to
    ``dtype`` as they are looked up.
    """

    narrowable: tuple[str, ...] = ()

    def __init__(self, vocab_size: int, hidden_size: int, *, shard: Shard = SINGLE, tied: bool = False, **factory):
        super().__init__()
        self.shard = shard
        self.start, self.count = shard.part(vocab_size, "vocabulary")
        whole = shard.rank == 0
        self.weight = nn.Parameter(torch.empty(vocab_size if whole else self.count, hidden_size, **factory))
        self.dtype = self.weight.dtype  # of the rows it returns, however the weight is stored
        self.checkpoint_parts = {} if whole else {"weight": Part(0, shard.rank, shard.size)}
        if tied:
            self.narrowable = ("weight",)

    def rows(self) -> Tensor:
        """This rank's ``[V / size, H]`` rows (on rank 0 a view of the whole matrix, whose first rows they are)."""
        return self.weight[: self.count]

    def forward(self, ids: Tensor) -> Tensor:
        if not self.shard.parallel:
            return self.embed_whole(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        rows = F.embedding(local.masked_fill(outside, 0), self.rows()).to(self.dtype)
        return self.shard.all_reduce(rows.masked_fill(outside[:, None], 0))

    def logits(self, hidden: Tensor) -> Tensor:
        """``hidden: [N, H] -> [N, V] float32``, the scores of every id against these rows (a tied head)."""
        if not self.shard.parallel:
            return linear(hidden, self.weight).float()
        return self.shard.all_gather(linear(hidden, self.rows()), dim=-1).float().contiguous()

    def embed_whole(self, ids: Tensor) -> Tensor:
        """:meth:`forward` over the whole matrix with no collective: rank 0 only (the drafts' ``embed``)."""
        return F.embedding(ids, self.weight).to(self.dtype)

    def logits_whole(self, hidden: Tensor) -> Tensor:
        """:meth:`logits` over the whole matrix with no collective: rank 0 only (the drafts' ``lm_head``)."""
        return linear(hidden, self.weight).float()


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head ``hidden: [N, H] -> logits [N, V] float32`` (:meth:`logits`), this rank scoring its ids; the
    weight may be stored narrower (:func:`tandem.models.linear.narrow_exact_weights`)."""

    narrowable = ("weight",)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.logits(hidden)
