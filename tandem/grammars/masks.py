"""SpeculativeMasker: per-position grammar masks for a speculative step, and commits.

For a batch row with drafts d[0:k], mask row i (0 <= i <= k) holds the tokens allowed after the
grammar consumed d[0:i]; row k is for the bonus token. Positions in thinking, and rows without a
grammar, get the *base* row (every id the tokenizer has; ids in [tokenizer size, V) are never
allowed), except that a row with a grammar may not end while thinking: its thinking positions get
the *thinking* row, the base row without the end tokens (EOS), so a constrained request always
reaches its answer (or its length limit) instead of ending with no answer at all. The walk stops
at the first draft the grammar forbids: later rows get the base row (that draft is rejected
anyway). Matchers are rolled back by exactly what the walk accepted, so `fill` leaves no state
behind; `commit` is the only call that advances matchers and trackers. `MaskWalk` is the same
walk one position at a time, for drafts that propose under the grammar.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from tandem.core.bitmask import bitmask_width, pack_bitmask, unpack_bitmask
from tandem.core.transfer import to_device
from tandem.grammars.backends.base import Matcher
from tandem.thinking import ThinkingTracker


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

    def has_grammar(self, row_id: Hashable) -> bool:
        """Whether the row is constrained (it has a matcher), not only tracked for its thinking phases."""
        return self._rows[row_id].matcher is not None

    def fill(
        self, row_ids: Sequence[Hashable], drafts: torch.Tensor, bitmask: torch.Tensor, in_thinking: torch.Tensor
    ) -> torch.Tensor:
        """Write masks for a batch; matchers and trackers end unchanged.

        row_ids: B ids given to `add_row`; drafts: [B, k] int64 CPU (k may be 0); a row with fewer
        drafts pads them with PLACEHOLDER_TOKEN_ID (-1), which ends its walk like a forbidden draft.
        bitmask: [>=B, k+1, W] int32 CPU contiguous, filled in rows [0, B).
        in_thinking: [>=B, k+1] bool CPU, filled in rows [0, B) (True = position inside <think>).
        Returns allows_nothing: [B, k+1] bool, True where the grammar allows no token at all
        (the engine ends such a row if it has to emit there).
        """
        walk = MaskWalk(self, row_ids, drafts.shape[1], bitmask, in_thinking)
        for column in drafts.T.tolist():
            walk.advance(column)
        return walk.finish()

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


class MaskWalk:
    """`SpeculativeMasker.fill`'s walk, one window position at a time: mask row i of every batch row
    is written as soon as the window's first i tokens are known.

    A draft can so read row i before it picks token i (grammar-aware drafting: it then proposes
    only tokens the grammar allows, which the target's masked acceptance would otherwise reject).
    It implements :class:`tandem.models.base.DraftConstraint`. Until :meth:`finish` the matchers
    hold the walked tokens; nothing may commit to the masker in between.
    """

    def __init__(
        self,
        masker: SpeculativeMasker,
        row_ids: Sequence[Hashable],
        k: int,
        bitmask: torch.Tensor,
        in_thinking: torch.Tensor,
        device: torch.device | str = "cpu",
    ):
        batch = len(row_ids)
        if bitmask.shape[1:] != (k + 1, masker.width) or bitmask.dtype != torch.int32:
            raise ValueError(
                f"bitmask must be int32 [B, {k + 1}, {masker.width}], got {bitmask.dtype} {list(bitmask.shape)}"
            )
        if bitmask.shape[0] < batch or in_thinking.shape[0] < batch or in_thinking.shape[1] != k + 1:
            raise ValueError(
                f"buffers {list(bitmask.shape)} / {list(in_thinking.shape)} too small for {batch} rows, k={k}"
            )
        if bitmask.device.type != "cpu" or in_thinking.device.type != "cpu" or not bitmask.is_contiguous():
            # The backends write the rows through raw host pointers: a device buffer would crash the process.
            raise ValueError(
                f"bitmask must be a contiguous CPU tensor and in_thinking a CPU tensor, got "
                f"{bitmask.device} (contiguous: {bitmask.is_contiguous()}) / {in_thinking.device}"
            )
        self.masker, self.k, self.device = masker, k, torch.device(device)
        self.bitmask, self.in_thinking = bitmask[:batch], in_thinking[:batch]
        self._flat = bitmask.view(-1, masker.width)  # the backends fill [N, W] rows by index
        self._states = [masker.row(row_id) for row_id in row_ids]
        self._tokens: list[list[int]] = [[] for _ in row_ids]
        self._walking = [state.matcher is not None for state in self._states]  # False after a forbidden token
        self._accepted = [0] * batch  # tokens each matcher consumed, to roll back
        self.position = 0
        self._fill_position()

    def allowed(self) -> torch.Tensor:
        """``[B, V]`` bool on the walk's device: the tokens allowed at the current position."""
        # Packed words cross to the device (32x fewer bytes than the bools), then unpack there.
        return unpack_bitmask(to_device(self.bitmask[:, self.position], self.device), self.masker.vocab_size)

    def advance(self, tokens: Sequence[int] | torch.Tensor) -> None:
        """Take token ``position`` of every row (``[B]``; -1 = no token) and write the next mask row."""
        if self.position == self.k:
            raise RuntimeError(f"the walk is already past its k = {self.k} tokens")
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        for b, token in enumerate(tokens):
            thinking = bool(self.in_thinking[b, self.position])
            self._tokens[b].append(token)
            if self._walking[b] and not thinking:  # a token reaches the grammar iff its position is not thinking
                # The first forbidden token (or a PLACEHOLDER_TOKEN_ID pad) is rejected anyway.
                if token >= 0 and self._states[b].matcher.accept_token(token):
                    self._accepted[b] += 1
                else:
                    self._walking[b] = False
        self.position += 1
        self._fill_position()

    def finish(self) -> torch.Tensor:
        """Roll the matchers back; returns allows_nothing ``[B, position+1]`` bool (the rows written)."""
        for state, accepted in zip(self._states, self._accepted):
            if accepted:
                state.matcher.rollback(accepted)
        self._accepted = [0] * len(self._states)
        return (self.bitmask[:, : self.position + 1] == 0).all(-1)

    def _fill_position(self) -> None:
        i, width = self.position, self.k + 1
        for b, state in enumerate(self._states):
            thinking = state.tracker.phases(self._tokens[b])[-1] if state.tracker else False
            self.in_thinking[b, i] = thinking
            if state.matcher is None or not self._walking[b]:  # after a forbidden token: never read
                self._flat[b * width + i] = self.masker.base_row
            elif thinking:
                self._flat[b * width + i] = self.masker.thinking_row
            else:
                state.matcher.fill_bitmask(self._flat, b * width + i)
