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

Forced tokens: a position whose mask row allows exactly one token (one bit set: exact, and a few
microseconds on the row the walk wrote anyway) is *forced*; the target's masked distribution there
is that token alone, so a draft of it is accepted whenever the drafts before it were. A walk that
`detect_forced` records them, and `MaskWalk.extend_forced` walks on past the draft's tokens with them.

Closing within the budget: with a `Closer` and the rows' remaining budgets, a row near its budget gets
closing masks (`tandem.grammars.closing`): its grammar's mask narrowed to the tokens that keep a
completion within the tokens left, and at a thinking position where nothing but `</think>` and the
shortest answer fit, `</think>` alone. A row keeps the witness of its committed state and the budget
left there; both follow every committed token (`commit`), so the masks of a state never depend on how
many tokens a step verified. An unsettled witness (a quick search's) is searched again wide at the first
state where its slack falls below the closer's `settle`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.core.bitmask import bitmask_width, pack_bitmask, unpack_bitmask
from tandem.core.transfer import to_device
from tandem.grammars.backends.base import Matcher, set_token_bit
from tandem.grammars.closing import UNKNOWN, Closer, Witness
from tandem.thinking import ThinkingTracker

MAX_START_WITNESSES = 1024  # grammars whose start state's witness is kept


@dataclass
class Closing:
    """A grammar state's closing: its witness, its closing mask row (None: not restricted yet), and whether the
    witness is settled (`Closer.fresh`: a quick search's is not, until searched again wide)."""

    witness: Witness | None | str = UNKNOWN
    row: torch.Tensor | None = None
    settled: bool = True


@dataclass
class GrammarRow:
    """One request's grammar state: a matcher (None = unconstrained) and a thinking tracker (None = no reasoning);
    with closing, the budget left at the committed state (None: not known yet) and that state's closing."""

    matcher: Matcher | None
    tracker: ThinkingTracker | None = None
    grammar: Hashable | None = None  # what the matcher walks: rows of one grammar share its start state's witness
    remaining: int | None = None
    committed: Closing = field(default_factory=Closing)
    history: list[int] = field(default_factory=list)  # the committed tokens the grammar took
    # Closing per state (the grammar's tokens, tokens left), so a state the walks of two steps reach is searched
    # and restricted once.
    closing: dict[tuple[tuple[int, ...], int], Closing] = field(default_factory=dict)


def single_token(row: torch.Tensor | np.ndarray) -> int:
    """The one token a bitmask row (int32 [W], CPU, or its numpy view) allows; -1 when it allows none or several."""
    words = row.numpy() if isinstance(row, torch.Tensor) else row
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return -1
    word = int(words[nonzero[0]]) & 0xFFFFFFFF  # bit 31 is the int32 sign bit
    if word & (word - 1):
        return -1
    return int(nonzero[0]) * 32 + word.bit_length() - 1


class SpeculativeMasker:
    """Fills `[B, k+1, W]` int32 host bitmasks and `[B, k+1]` thinking flags for rows it tracks."""

    def __init__(
        self,
        vocab_size: int,
        tokenizer_size: int | None = None,
        *,
        end_token_ids: Sequence[int] = (),
        closer: Closer | None = None,
    ):
        self.vocab_size, self.closer = vocab_size, closer
        self.width = bitmask_width(vocab_size)
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        allowed[: vocab_size if tokenizer_size is None else tokenizer_size] = True
        self.base_row = pack_bitmask(allowed)  # [W] int32
        allowed[list(end_token_ids)] = False
        self.thinking_row = pack_bitmask(allowed)  # [W] int32: thinking positions of rows with a grammar
        self._rows: dict[Hashable, GrammarRow] = {}
        # A grammar -> the wide search's witness from its start state and the budget it was searched within
        # (`_fresh`): a function of the grammar alone, searched once for all its rows.
        self._start_witnesses: dict[Hashable, tuple[Witness | None, int]] = {}

    def add_row(
        self,
        row_id: Hashable,
        matcher: Matcher | None,
        tracker: ThinkingTracker | None = None,
        grammar: Hashable | None = None,
    ) -> None:
        """Start tracking a request; `matcher` must not have consumed anything after the prompt; `grammar`: a key
        of what it walks (the compiled grammar), shared by rows of the same one (None: shares nothing)."""
        if row_id in self._rows:
            raise KeyError(f"row {row_id!r} is already tracked")
        self._rows[row_id] = GrammarRow(matcher, tracker, grammar)

    def remove_row(self, row_id: Hashable) -> None:
        del self._rows[row_id]

    def row(self, row_id: Hashable) -> GrammarRow:
        return self._rows[row_id]

    def has_grammar(self, row_id: Hashable) -> bool:
        """Whether the row is constrained (it has a matcher), not only tracked for its thinking phases."""
        return self._rows[row_id].matcher is not None

    def fill(
        self,
        row_ids: Sequence[Hashable],
        drafts: torch.Tensor,
        bitmask: torch.Tensor,
        in_thinking: torch.Tensor,
        remaining: Sequence[int | None] | None = None,
    ) -> torch.Tensor:
        """Write masks for a batch; matchers and trackers end unchanged.

        row_ids: B ids given to `add_row`; drafts: [B, k] int64 CPU (k may be 0); a row with fewer
        drafts pads them with PLACEHOLDER_TOKEN_ID (-1), which ends its walk like a forbidden draft.
        bitmask: [>=B, k+1, W] int32 CPU contiguous, filled in rows [0, B).
        in_thinking: [>=B, k+1] bool CPU, filled in rows [0, B) (True = position inside <think>).
        remaining: per row, the tokens it may still emit, position 0's included (None: the budgets the rows
        were last given, if any; a row without one gets no closing masks).
        Returns allows_nothing: [B, k+1] bool, True where the grammar allows no token at all
        (the engine ends such a row if it has to emit there).
        """
        walk = MaskWalk(self, row_ids, drafts.shape[1], bitmask, in_thinking, remaining=remaining)
        for column in drafts.T.tolist():
            walk.advance(column)
        return walk.finish()

    def commit(self, row_id: Hashable, tokens: Sequence[int]) -> None:
        """Advance a row's tracker and matcher by exactly the committed tokens (mutates).

        Raises RuntimeError if the grammar forbids a committed token: emitted tokens come from
        masked distributions, so this means the masks and the commit disagree.
        """
        state = self._rows[row_id]
        phases = state.tracker.phases(tokens) if state.tracker else [False] * (len(tokens) + 1)
        if state.tracker:
            state.tracker.commit(tokens)
        if state.matcher is None:
            return
        for token, thinking in zip(tokens, phases):
            if not thinking:
                if not state.matcher.accept_token(token):
                    raise RuntimeError(f"row {row_id!r}: committed token {token} is forbidden by its grammar")
                state.history.append(token)
            if state.remaining is not None:  # closing: the witness follows the committed state
                state.remaining -= 1
                key = (tuple(state.history), state.remaining)
                state.committed = self._closing(state, key, state.committed, None if thinking else token)
        if state.remaining is not None:  # states before the committed one are never reached again
            state.closing = {key: entry for key, entry in state.closing.items() if len(key[0]) >= len(state.history)}

    def _closing(
        self, state: GrammarRow, key: tuple[tuple[int, ...], int], before: Closing, token: int | None
    ) -> Closing:
        """The closing of the state the matcher is in, `key`, reached by `token` (None: by a token the grammar did
        not see, in thinking) from a state whose closing is `before`; derived (searched if need be) once."""
        entry = state.closing.get(key)
        if entry is None:
            witness, settled, remaining = before.witness, before.settled, key[1]
            if token is not None:
                witness = self.closer.derive(state.matcher, witness, token)
            known = isinstance(witness, tuple)
            # Unfit: a proof may have kept `token` with a shorter completion. Unsettled: near enough to search wide.
            unfit = witness == UNKNOWN or (known and len(witness) > remaining)
            unsettled = known and not settled and remaining - len(witness) < self.closer.settle
            if (unfit or unsettled) and self.closer.active(remaining):
                found, settled = self._fresh(state, key)
                witness = witness if found is None else found
                settled = settled or found is None  # a wide search that finds none is not run again
            entry = state.closing[key] = Closing(witness, None, settled)
        return entry

    def _fresh(self, state: GrammarRow, key: tuple[tuple[int, ...], int]) -> tuple[Witness | None, bool]:
        """`Closer.fresh` at the state `key`. At a grammar's start state the wide search runs once for all its
        rows: breadth-first and deterministic, it finds the same witness within any budget from that witness's
        length up, and none within a budget below one it found none within."""
        tokens, remaining = key
        if tokens or state.grammar is None:
            return self.closer.fresh(state.matcher, remaining)
        witness, searched = self._start_witnesses.get(state.grammar, (None, -1))
        if witness is None and remaining > searched:
            witness = self.closer.search(state.matcher, remaining)
            if len(self._start_witnesses) >= MAX_START_WITNESSES:
                self._start_witnesses.pop(next(iter(self._start_witnesses)))  # the oldest
            self._start_witnesses[state.grammar] = witness, remaining
        if witness is not None and len(witness) <= remaining:
            return witness, True
        return self.closer.search(state.matcher, remaining, *self.closer.proof), True

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

    `k` is the walk's capacity: a draft advances it by its k tokens, and `extend_forced` may go on with
    forced tokens up to the capacity. A row's *path* is its tokens up to the first one that stops it (a
    placeholder, or a token its grammar forbids); `forced[b][i]` is the token forced at position i of
    row b (-1: none, or not detected), for positions on the path.
    """

    def __init__(
        self,
        masker: SpeculativeMasker,
        row_ids: Sequence[Hashable],
        k: int,
        bitmask: torch.Tensor,
        in_thinking: torch.Tensor,
        device: torch.device | str = "cpu",
        *,
        detect_forced: bool = False,
        remaining: Sequence[int | None] | None = None,
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
        # Per-element reads and writes go through numpy views: on a tensor each is a torch dispatch.
        self._words, self._thinking = self._flat.numpy(), self.in_thinking.numpy()
        self._base_row, self._thinking_row = masker.base_row.numpy(), masker.thinking_row.numpy()
        self._states = [masker.row(row_id) for row_id in row_ids]
        self._tokens: list[list[int]] = [[] for _ in row_ids]
        self._walking = [state.matcher is not None for state in self._states]  # False after a forbidden token
        self._accepted = [0] * batch  # tokens each matcher consumed, to roll back
        self.detect_forced = detect_forced
        self.lengths = [0] * batch  # tokens on each row's path
        self._stopped = [False] * batch
        self.forced: list[list[int]] = [[] for _ in row_ids]
        if remaining is None:  # the budgets the rows were last given (kept by `commit`)
            remaining = [state.remaining for state in self._states]
        self._remaining = [None] * batch if masker.closer is None else list(remaining)
        self._closing: list[Closing | None] = [None] * batch  # each row's closing at the current position
        self._history = [list(state.history) for state in self._states]  # + the walked tokens the grammar took
        for b, state in enumerate(self._states):
            if state.matcher is None or self._remaining[b] is None:
                self._remaining[b] = None
                continue
            state.remaining = self._remaining[b]  # from now on `commit` keeps it
            key = (tuple(state.history), state.remaining)
            state.committed = self._closing[b] = masker._closing(state, key, state.committed, None)
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
            thinking = bool(self._thinking[b, self.position])
            self._tokens[b].append(token)
            allowed = token >= 0
            if self._walking[b] and not thinking:  # a token reaches the grammar iff its position is not thinking
                # The first forbidden token (or a PLACEHOLDER_TOKEN_ID pad) is rejected anyway.
                allowed = allowed and self._states[b].matcher.accept_token(token)
                self._accepted[b] += allowed
                self._walking[b] = allowed
                if allowed:
                    self._history[b].append(token)
            if self._remaining[b] is not None and self._walking[b]:
                key = (tuple(self._history[b]), self._remaining[b] - self.position - 1)
                before = self._closing[b]
                self._closing[b] = self.masker._closing(self._states[b], key, before, None if thinking else token)
            self._stopped[b] = self._stopped[b] or not allowed
            self.lengths[b] += not self._stopped[b]
        self.position += 1
        self._fill_position()

    def _must_close(self, b: int, i: int) -> bool:
        """Whether row b, thinking at position i, has just room for `</think>` and its witness's answer."""
        witness = self._closing[b].witness
        return isinstance(witness, tuple) and self._remaining[b] - i == len(witness) + 1

    def path(self, b: int) -> list[int]:
        """Row b's tokens on its path (every token before the first that stopped it)."""
        return self._tokens[b][: self.lengths[b]]

    def forced_run(self, b: int, start: int) -> int:
        """How many positions from `start` on row b's path (or just past its end) are forced in a row."""
        run = 0
        while start + run < len(self.forced[b]) and self.forced[b][start + run] >= 0:
            run += 1
        return run

    def advance_proposals(
        self, proposals: Sequence[Sequence[int]], model_limits: Sequence[int], limits: Sequence[int]
    ) -> None:
        """Walk the proposals of a draft that ignores the grammar (n-gram, suffix), up to the capacity.

        Row b takes `proposals[b]` up to `model_limits[b]` tokens, except that a forced position takes
        the forced token and ends the proposal there (what followed was copied after another token);
        then, while its positions are forced and fewer than `limits[b]`, the forced tokens."""
        proposing = [True] * len(proposals)
        while self.position < self.k:
            i, tokens = self.position, []
            for b, proposal in enumerate(proposals):
                forced = self.forced[b][i] if self.lengths[b] == i and i < limits[b] else -1
                token = proposal[i] if proposing[b] and i < min(model_limits[b], len(proposal)) else -1
                proposing[b] = token >= 0 and (forced < 0 or forced == token)
                tokens.append(token if proposing[b] else forced)
            if all(t < 0 for t in tokens):
                return
            self.advance(tokens)

    def extend_forced(self, starts: Sequence[int], limits: Sequence[int]) -> None:
        """Walk on with forced tokens up to the capacity: row b takes the forced token at position i while
        i < limits[b] and every position from starts[b] to i was forced on its path; other rows pad (-1)."""
        while self.position < self.k:
            i = self.position
            tokens = [
                self.forced[b][i]
                if self.lengths[b] == i and i < limits[b] and starts[b] + self.forced_run(b, starts[b]) > i
                else -1
                for b in range(len(self._states))
            ]
            if all(t < 0 for t in tokens):
                return
            self.advance(tokens)

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
            self._thinking[b, i] = thinking
            forced = -1
            if state.matcher is None or not self._walking[b]:  # after a forbidden token: never read
                self._words[b * width + i] = self._base_row
            elif thinking:
                self._words[b * width + i] = self._thinking_row
                if self._remaining[b] is not None and self._must_close(b, i):
                    self._flat[b * width + i].zero_()
                    set_token_bit(self._flat[b * width + i], state.tracker.markers.close_id)
                    forced = state.tracker.markers.close_id if self.detect_forced and not self._stopped[b] else -1
            elif self._remaining[b] is not None and self._closing[b].row is not None:  # restricted before
                self._flat[b * width + i] = self._closing[b].row
            else:
                state.matcher.fill_bitmask(self._flat, b * width + i)
                if self._remaining[b] is not None:
                    row = self._flat[b * width + i]
                    self.masker.closer.restrict(row, state.matcher, self._closing[b].witness, self._remaining[b] - i)
                    self._closing[b].row = row.clone()
            grammar = state.matcher is not None and self._walking[b] and not thinking
            if grammar and self.detect_forced and not self._stopped[b]:
                forced = single_token(self._words[b * width + i])
            self.forced[b].append(forced)
