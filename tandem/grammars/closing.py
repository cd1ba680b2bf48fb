"""Answers that close within the token budget: a witness of a short completion, and closing masks.

A row with r tokens left at a position (the token there included) ends valid only if, after the
token it emits there, its grammar can reach an accepting state (one where it may end) in r - 1
tokens. Closing masks allow, once the budget is near, only tokens for which that is *proven*:

- a *witness* of the current state is a token sequence after which the grammar may end, |P| = W
  tokens (0: it may end now). W bounds the shortest completion from above; the closing is feasible
  iff W <= r, and a row whose witness does not fit (or none was found) is left unrestricted;
- a token t is proven when it is EOS where the grammar may end, or t = P[0] (then W - 1 tokens finish
  it), or t followed by P[1:] ends (t *replaces* P[0]), or, with slack r - W >= 1, t followed by all
  of P ends (t is *inserted*), or, at a structural position (at most `candidates` tokens allowed), a
  narrower search (`proof`) from after t finds a completion in r - 1 tokens (t opens a structure or
  takes another branch). Every allowed token is so proven by a sequence the matcher accepted: no mask
  allows a token from which the grammar cannot end within the budget, and P[0] is always allowed, so
  a feasible row never dead-ends;
- a position allows only its proven tokens once the slack is below `reach` (structural) or `horizon`
  (free text: more allowed tokens, a string's characters, which write text and rarely lengthen the
  witness, an escape by a token or two); a free-text position checks its first `candidates` tokens in
  `token_order` and refuses the rest: near the budget, text ends. Before that nothing is restricted,
  so a single token that lengthens the shortest completion by more than `reach` tokens at once (an
  object with that many required keys, opened as an optional value) can still outrun the budget.

Witnesses are *derived* along the tokens a row takes: after token t, P[1:] if t = P[0], else P[1:] or
P if that still ends, or P's text less t's where it starts with it, split at t's end (`_resplit`: a
number or a name the row writes in other pieces than P's); when none does, or the derived one no longer
fits the budget (t was kept by a proof, whose completion is shorter), a fresh `search` (and, when it
finds none within the budget, the narrower one of the proofs, which finds again the completion that kept
t). Where the budget leaves room, a *quick* search (a beam of one) comes first: its witness may be a few
tokens longer than the wide search's, which matters only near the budget, so it is kept while it leaves a
slack of at least `settle` and is searched again wide once it does not (it is *unsettled* until then). A
search is a breadth-first walk over the matcher
with rollback, per level the states deduplicated by their next-token mask, a token that leaves a
free-text state (more than `free_text` tokens allowed) with the same mask not followed (it wrote text
and went nowhere), the `beam` states that wrote the most text kept (then the fewest tokens allowed),
each expanded by its first `branch` allowed tokens in `token_order`. A searched witness is real (the
matcher accepted it) but may be longer than the shortest completion. The search knows no grammar,
only the order it tries tokens in (`closing_token_order`: tokens that start with a quote or a closing
bracket, other punctuation, digits, the rest, each class shortest first), a cheap preference for
tokens that end spans.

Cost: nothing until a row has at most `window` tokens left; then a derivation per position (a replay
of at most W tokens), a search where derivation fails (a quick one while the slack is ample), and at a
restricted position up to two replays per allowed token (at most `candidates`) and a proof search per
structural token no replay proves.
The masker computes each state's witness and closing mask once (`grammars.masks`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.grammars.backends.base import Matcher, set_token_bit

Witness = tuple[int, ...]
UNKNOWN = "unknown"  # a witness not derived yet (`Closer.derive` failed, or the row was never near)


CLOSERS = frozenset("\"')]}>")  # characters that end a quoted or bracketed span in most grammars


def closing_token_order(token_texts: Sequence[str]) -> list[int]:
    """Token ids in the order closing tries them, shortest first within each class: tokens that start with a
    closing character (`CLOSERS`, after spaces), other punctuation-only tokens, digits, the rest."""

    def rank(token: int) -> tuple[int, int]:
        text = token_texts[token]
        if text.lstrip()[:1] in CLOSERS and text.strip():
            return 0, len(text)
        if text and not any(c.isalnum() for c in text):
            return 1, len(text)
        return (2 if text.strip().isdigit() else 3), len(text)

    return sorted(range(len(token_texts)), key=rank)


def _popcount(words: np.ndarray) -> int:
    return int(np.bitwise_count(words.view(np.uint32)).sum())


class Closer:
    """Witness search and derivation, and the closing restriction of a mask row (module docstring)."""

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, end_token_ids: Sequence[int], **options) -> Closer:
        """A closer over an HF tokenizer's vocabulary (each token decoded once, to order them)."""
        texts = tokenizer.batch_decode([[t] for t in range(len(tokenizer))])
        return cls(vocab_size, closing_token_order(texts), end_token_ids, texts, **options)

    def __init__(
        self,
        vocab_size: int,
        token_order: Sequence[int],
        end_token_ids: Sequence[int],
        token_texts: Sequence[str] | None = None,
        *,
        window: int = 64,
        horizon: int = 4,
        reach: int = 8,
        candidates: int = 64,
        beam: int = 12,
        branch: int = 24,
        free_text: int = 32,
        proof: tuple[int, int] = (4, 12),
        quick: tuple[int, int] = (1, 8),
        settle: int = 16,
    ):
        self.vocab_size, self.window, self.horizon, self.reach = vocab_size, window, horizon, reach
        self.candidates, self.beam, self.branch, self.free_text = candidates, beam, branch, free_text
        self.proof = proof  # (beam, branch) of the search that proves a structural token: a narrower one
        self.quick, self.settle = quick, settle  # (beam, branch) of the quick search; the slack it must leave
        self.order = np.asarray(token_order, dtype=np.int64)
        self.texts = list(token_texts) if token_texts is not None else None  # each token's text alone
        self.lengths = [len(t) for t in self.texts] if self.texts is not None else [1] * vocab_size  # its characters
        self._by_text: dict[str, int] = {}  # a text -> the first token that writes it alone
        for token, text in enumerate(self.texts or ()):
            self._by_text.setdefault(text, token)
        self.end_ids = list(end_token_ids)
        self._scratch = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self._scratch_words = self._scratch.numpy()[0]  # the row `_fill` copies out, viewed once

    def active(self, remaining: int | None) -> bool:
        """Whether a position with `remaining` tokens left (None: no budget) is near enough to close."""
        return remaining is not None and remaining <= self.window

    # ------------------------------------------------------------ witnesses
    def search(
        self, matcher: Matcher, limit: int, beam: int | None = None, branch: int | None = None
    ) -> Witness | None:
        """A completion of at most `limit` tokens from the matcher's state (module docstring; `beam` and `branch`
        default to the closer's), or None; the matcher ends unchanged."""
        beam, branch = beam or self.beam, branch or self.branch
        frontier: list[Witness] = [()]
        for _ in range(limit + 1):
            level: dict[bytes, tuple[int, int, Witness]] = {}
            for path in frontier:
                self._accept(matcher, path)
                row = self._fill(matcher)
                if matcher.is_terminated() or self._can_end(row):
                    matcher.rollback(len(path))
                    return path
                same = row.tobytes() if _popcount(row) > self.free_text else None  # free text: no new state
                written = sum(self.lengths[t] for t in path)
                for token in self._in_order(row, branch):
                    if not matcher.accept_token(token):
                        continue
                    child = self._fill(matcher)
                    matcher.rollback(1)
                    key = child.tobytes()
                    if key not in level and key != same:
                        level[key] = (-written - self.lengths[token], _popcount(child), len(level), (*path, token))
                matcher.rollback(len(path))
            frontier = [path for *_, path in sorted(level.values())[:beam]]
            if not frontier:
                return None
        return None

    def fresh(self, matcher: Matcher, limit: int) -> tuple[Witness | None, bool]:
        """A witness of at most `limit` tokens searched from the matcher's state, and whether it is settled: the
        quick search's while it leaves a slack of `settle` (unsettled), else the wide search's, else the narrow
        one's that `restrict` proves structural tokens with, so that a token kept by such a proof finds its
        completion again from the state after it (the searches are deterministic; their beams prune different
        paths)."""
        if limit > self.settle:
            witness = self.search(matcher, limit - self.settle, *self.quick)
            if witness is not None:
                return witness, False
        witness = self.search(matcher, limit)
        return (witness if witness is not None else self.search(matcher, limit, *self.proof)), True

    def derive(self, matcher: Matcher, witness: Witness | None | str, token: int) -> Witness | None | str:
        """The witness after `token`, which the matcher has just accepted, from the one before it; UNKNOWN
        when it cannot be derived (then `search`). None stays None: a budget only shrinks."""
        if witness is None or witness == UNKNOWN:
            return witness
        if witness[:1] == (token,):
            return witness[1:]
        for candidate in (witness[1:], witness, *self._resplit(witness, token)):
            if self.ends(matcher, candidate):
                return candidate
        return UNKNOWN

    def _resplit(self, witness: Witness, token: int) -> list[Witness]:
        """The witness less the text `token` wrote, when its text starts with that text split otherwise (`2020`
        after `202`: `0`, then the tokens after `2020`): the tokens after the ones the text covers, after a
        token of what the text leaves of the last of them (none when no single token writes it)."""
        if self.texts is None:
            return []
        written, text, covered = self.texts[token], "", 0
        while len(text) < len(written) and covered < len(witness):
            text += self.texts[witness[covered]]
            covered += 1
        if not text.startswith(written):
            return []
        rest = text[len(written) :]
        if not rest:
            return [witness[covered:]]
        piece = self._by_text.get(rest)
        return [] if piece is None else [(piece, *witness[covered:])]

    def ends(self, matcher: Matcher, tokens: Sequence[int]) -> bool:
        """Whether the grammar accepts `tokens` from the matcher's state and may end after them; the matcher
        ends unchanged."""
        accepted = 0
        for token in tokens:
            if not matcher.accept_token(token):
                break
            accepted += 1
        ok = accepted == len(tokens) and (matcher.is_terminated() or self._can_end(self._fill(matcher)))
        matcher.rollback(accepted)
        return ok

    # ------------------------------------------------------------ masks
    def restrict(self, row: torch.Tensor, matcher: Matcher, witness: Witness | None | str, remaining: int) -> None:
        """Narrow a mask row (int32 [W], the grammar's mask at the matcher's state) to the tokens that keep a
        completion within `remaining` tokens (this one included), as the module docstring says; mutates
        `row` only when the witness fits."""
        if not isinstance(witness, tuple) or remaining < len(witness):
            return
        slack = remaining - len(witness)
        if slack >= max(self.reach, self.horizon):  # whatever the position's kind
            return
        words = row.numpy().copy()
        tokens = self._in_order(words)
        structural = len(tokens) <= self.candidates
        if slack >= (self.reach if structural else self.horizon):
            return
        keep = [t for t in self.end_ids if self._has(words, t)] + list(witness[:1])
        for token in tokens[: self.candidates]:
            if witness[:1] == (token,) or not matcher.accept_token(token):
                continue
            if (
                self.ends(matcher, witness[1:])
                or (slack >= 1 and self.ends(matcher, witness))
                or (structural and self.search(matcher, remaining - 1, *self.proof) is not None)
            ):
                keep.append(token)
            matcher.rollback(1)
        row.zero_()
        for token in keep:
            set_token_bit(row, token)

    # ------------------------------------------------------------ helpers
    def _accept(self, matcher: Matcher, tokens: Sequence[int]) -> None:
        for token in tokens:
            if not matcher.accept_token(token):
                raise RuntimeError(f"closing search: token {token} of its own path was refused")

    def _fill(self, matcher: Matcher) -> np.ndarray:
        """int32 [W]: the matcher's mask row (a copy)."""
        matcher.fill_bitmask(self._scratch, 0)
        return self._scratch_words.copy()

    @staticmethod
    def _has(words: np.ndarray, token: int) -> bool:
        return bool((int(words[token // 32]) >> (token % 32)) & 1)

    def _can_end(self, words: np.ndarray) -> bool:
        return any(self._has(words, t) for t in self.end_ids)

    def _in_order(self, words: np.ndarray, first: int | None = None) -> list[int]:
        """The tokens a mask row allows, ends excluded, in `token_order` (the `first` of them; None: all)."""
        allowed = np.unpackbits(words.astype("<i4", copy=False).view(np.uint8), bitorder="little").view(bool)
        allowed[self.end_ids] = False
        return self.order[allowed[self.order]][:first].tolist()
