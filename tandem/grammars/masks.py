"""SpeculativeMasker: per-position grammar masks for a speculative step, and commits.

For a batch row with drafts d[0:k], mask row i (0 <= i <= k) holds the tokens allowed after the
grammar consumed d[0:i]; row k is for the bonus token. Positions in thinking, and rows without a
grammar, get the *base* row (every id the tokenizer has; ids in [tokenizer size, V) are never
allowed), except that a row with a grammar may not end while thinking: its thinking positions get
the *thinking* row, the base row without the end tokens (EOS), so a constrained request always
reaches its answer (or its length limit) instead of ending with no answer at all. The walk stops at the first draft the grammar forbids: later rows get the base row (that
draft is rejected anyway). Matchers are rolled back by exactly what the walk accepted, so `fill`
leaves no state behind; `commit` is the only call that advances matchers and trackers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from tandem.decoding.bitmask import bitmask_width, pack_bitmask
from tandem.grammars.backends.base import Matcher
from tandem.grammars.thinking import ThinkingTracker


@dataclass
class GrammarRow:
    """One request's grammar state: a matcher (None = unconstrained) and a thinking tracker (None = no reasoning)."""

    matcher: Matcher | None
    tracker: ThinkingTracker | None = None


class SpeculativeMasker:
    """Fills `[B, k+1, W]` int32 host bitmasks and `[B, k+1]` thinking flags for rows it tracks."""

    def __init__(self, vocab_size: int, tokenizer_size: int | None = None, *, end_token_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        allowed[: vocab_size if tokenizer_size is None else tokenizer_size] = True
        self.base_row = pack_bitmask(allowed)  # [W] int32
        allowed[list(end_token_ids)] = False
        self.thinking_row = pack_bitmask(allowed)  # [W] int32: thinking positions of rows with a grammar
        self._rows: dict[Hashable, GrammarRow] = {}

    def add_row(self, row_id: Hashable, matcher: Matcher | None, tracker: ThinkingTracker | None = None) -> None:
        """Start tracking a request; `matcher` must not have consumed anything after the prompt."""
        if row_id in self._rows:
            raise KeyError(f"row {row_id!r} is already tracked")
        self._rows[row_id] = GrammarRow(matcher, tracker)

    def remove_row(self, row_id: Hashable) -> None:
        del self._rows[row_id]

    def row(self, row_id: Hashable) -> GrammarRow:
        return self._rows[row_id]

    def fill(self, row_ids: Sequence[Hashable], drafts: torch.Tensor, bitmask: torch.Tensor, in_thinking: torch.Tensor) -> torch.Tensor:
        """Write masks for a batch; matchers and trackers end unchanged.

        row_ids: B ids given to `add_row`; drafts: [B, k] int64 CPU (k may be 0); a row with fewer
        drafts pads them with PLACEHOLDER_TOKEN_ID (-1), which ends its walk like a forbidden draft.
        bitmask: [>=B, k+1, W] int32 CPU contiguous, filled in rows [0, B).
        in_thinking: [>=B, k+1] bool CPU, filled in rows [0, B) (True = position inside <think>).
        Returns allows_nothing: [B, k+1] bool, True where the grammar allows no token at all
        (the engine ends such a row if it has to emit there).
        """
        batch, k = drafts.shape
        if bitmask.shape[1:] != (k + 1, self.width) or bitmask.dtype != torch.int32:
            raise ValueError(f"bitmask must be int32 [B, {k + 1}, {self.width}], got {bitmask.dtype} {list(bitmask.shape)}")
        if bitmask.shape[0] < batch or in_thinking.shape[0] < batch or in_thinking.shape[1] != k + 1:
            raise ValueError(f"buffers {list(bitmask.shape)} / {list(in_thinking.shape)} too small for drafts {list(drafts.shape)}")
        flat = bitmask.view(-1, self.width)  # the backends fill [N, W] rows by index
        phases = []
        for b, (row_id, tokens) in enumerate(zip(row_ids, drafts.tolist())):
            state = self._rows[row_id]
            row_phases = state.tracker.phases(tokens) if state.tracker else [False] * (k + 1)
            phases.append(row_phases)
            self._fill_row(state.matcher, tokens, row_phases, flat, b * (k + 1))
        in_thinking[:batch] = torch.tensor(phases, dtype=torch.bool).view(batch, k + 1)
        return (bitmask[:batch] == 0).all(-1)

    def _fill_row(self, matcher: Matcher | None, tokens: list[int], phases: list[bool], flat: torch.Tensor, first: int) -> None:
        """Rows flat[first : first+k+1] for one request; the matcher is rolled back before returning."""
        k = len(tokens)
        if matcher is None:
            flat[first : first + k + 1] = self.base_row
            return
        if all(phases):
            flat[first : first + k + 1] = self.thinking_row
            return
        accepted = 0
        for i in range(k + 1):
            if phases[i]:
                flat[first + i] = self.thinking_row
                continue
            matcher.fill_bitmask(flat, first + i)
            if i == k:
                break
            # The first forbidden draft (or a PLACEHOLDER_TOKEN_ID pad of a short draft) is rejected anyway.
            if tokens[i] < 0 or not matcher.accept_token(tokens[i]):
                flat[first + i + 1 : first + k + 1] = self.base_row
                break
            accepted += 1
        matcher.rollback(accepted)

    def commit(self, row_id: Hashable, tokens: Sequence[int]) -> None:
        """Advance a row's tracker and matcher by exactly the committed tokens (mutates).

        Raises RuntimeError if the grammar forbids a committed token: emitted tokens come from
        masked distributions, so this means the masks and the commit disagree.
        """
        state = self._rows[row_id]
        grammar_tokens = state.tracker.commit(tokens) if state.tracker else list(tokens)
        if state.matcher is None:
            return
        for token in grammar_tokens:
            if not state.matcher.accept_token(token):
                raise RuntimeError(f"row {row_id!r}: committed token {token} is forbidden by its grammar")

    def is_terminated(self, row_id: Hashable) -> bool:
        """Whether the row's grammar has accepted EOS (the request is complete)."""
        matcher = self._rows[row_id].matcher
        return matcher is not None and matcher.is_terminated()
