"""EAGLE-3's reduced draft vocabulary: the target tokens the draft head can name, chosen by frequency.

Stored as the published EAGLE-3 checkpoints store it (and :mod:`tandem.models.drafts.eagle3` reads
it): ``d2t [draft_V] int64``, draft id ``d`` -> target id ``d + d2t[d]``, and ``t2d [V] bool``, whether
a target id has a draft id. Draft ids follow target order (SpecForge's ``generate_vocab_mapping``),
so ``d2t`` is non-decreasing and non-negative.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftVocab:
    """The target ids a draft head predicts, ``token_ids [draft_V]`` int64 ascending, in a target vocabulary of
    ``target_vocab_size``."""

    token_ids: Tensor
    target_vocab_size: int

    @property
    def size(self) -> int:
        return len(self.token_ids)

    @property
    def d2t(self) -> Tensor:
        """``[draft_V]`` int64: target id minus draft id."""
        return self.token_ids - torch.arange(self.size, device=self.token_ids.device)

    @property
    def t2d(self) -> Tensor:
        """``[V]`` bool: the target ids that have a draft id."""
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool, device=self.token_ids.device)
        return mask.index_fill_(0, self.token_ids, True)

    def draft_ids(self) -> Tensor:
        """``[V]`` int64: each target id's draft id, -1 where it has none."""
        ids = torch.full((self.target_vocab_size,), -1, dtype=torch.long, device=self.token_ids.device)
        return ids.index_copy_(0, self.token_ids, torch.arange(self.size, device=self.token_ids.device))

    def to(self, device: torch.device | str) -> DraftVocab:
        return DraftVocab(self.token_ids.to(device), self.target_vocab_size)


def frequent_tokens(tokens: Iterable[int], target_vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent of ``tokens`` (ties: lower id first), completed with the
    lowest unseen ids when fewer distinct tokens occur, as SpecForge completes it."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} outside [1, target vocab size {target_vocab_size}]")
    counts = Counter(tokens)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:draft_vocab_size]]
    if len(chosen) < draft_vocab_size:
        seen = set(chosen)
        chosen += [t for t in range(target_vocab_size) if t not in seen][: draft_vocab_size - len(chosen)]
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.long), target_vocab_size)
