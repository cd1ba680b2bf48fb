"""Suffix draft: model-free proposals from a suffix trie of each row's tokens and of recent outputs.

Like Arctic Inference's suffix decoding. Each cache slot keeps a depth-bounded suffix trie of its
row's tokens (prompt and output): node ``s`` (a string of at most ``max_depth`` tokens) holds, per
next token ``t``, how often ``s`` was followed by ``t``. The trie is updated incrementally: the
slot keeps its *active* nodes, those of the current sequence's suffixes of length
``0 .. max_depth``, and appending a token extends each of them by one child (``O(max_depth)``
dictionary steps per committed token, never a rebuild). A new request in a slot (its history no
longer extends the one seen last, or a row starting at position 0) resets the slot.

Proposal: the longest suffix of the row's tokens with a recorded continuation (the deepest active
node with children), then greedily the most frequent next token (ties: the most recent), while
its empirical frequency ``count / total`` at that node stays at or above ``min_token_prob``; the
path's running product of these frequencies is the proposal's confidence, and it also stops
the walk when it falls below ``min_confidence``. A walk that reaches the depth bound re-anchors on
the longest suffix (of the tokens so far plus those proposed) found in the trie. Rows get fewer
than ``k`` tokens (padded with ``PLACEHOLDER_TOKEN_ID``) when the confidence drops.

A bounded global trie of recent outputs (``global_tokens`` > 0) is shared across rows: when a
slot is reset, its previous request's output (the tokens after its first proposal's history)
enters it, and the oldest outputs leave it (FIFO, their counts taken back) once it holds more than
``global_tokens`` tokens. A row's proposal comes from its own trie or from the global one,
whichever scores higher (the expected accepted length: the sum of the running products).

Host cost per step: ``O(max_depth)`` per committed token per trie, plus ``O(k)`` dictionary
walks for the proposal (``O(max_depth)`` more per re-anchor); the history prefix check is one
tensor comparison in C.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.core.transfer import to_device
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID
from tandem.models.base import DraftInput, DraftProposal, KVCache
from tandem.models.config import SuffixConfig


class Node:
    """A trie node: ``count`` = how often its string was followed by its last token from its
    parent; ``total`` = how often its string was followed by any token (the sum of the children's
    counts); ``last`` = when it was last counted (ties go to the most recent)."""

    __slots__ = ("children", "count", "total", "last")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0
        self.total = 0
        self.last = 0


class SuffixTrie:
    """A depth-bounded suffix trie over one or more token sequences, with incremental appends."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = Node()
        self.clock = 0  # a counter for recency

    def extend(self, active: list[Node], tokens: list[int]) -> list[Node]:
        """Append ``tokens`` to the sequence whose suffix nodes are ``active`` (``active[j]``: the
        suffix of length j <= ``max_depth``; ``[root]`` for an empty sequence); returns the new
        active nodes. The trie holds strings of up to ``max_depth + 1`` tokens: a context of up to
        ``max_depth`` and its continuation."""
        depth, root, clock = self.max_depth, self.root, self.clock
        for t in tokens:  # the hot loop: O(max_depth) dictionary steps per token
            clock += 1
            new = [root]
            for node in active:  # suffixes of length 0 .. depth: their continuations by t
                children = node.children
                child = children.get(t)
                if child is None:
                    child = children[t] = Node()
                child.count += 1
                child.last = clock
                node.total += 1
                new.append(child)
            if len(new) > depth + 1:  # strings of length depth + 1 only count continuations
                new.pop()
            active = new
        self.clock = clock
        return active

    def remove(self, active: list[Node], tokens: list[int]) -> list[Node]:
        """Take back the counts of ``extend(active, tokens)``, pruning nodes whose count drops to 0."""
        for t in tokens:
            new = [self.root]
            for node in active:
                child = node.children.get(t)
                if child is None:  # pruned: its longer suffixes were pruned too
                    break
                child.count -= 1
                node.total -= 1
                if child.count <= 0:
                    del node.children[t]
                new.append(child)
            active = new[: self.max_depth + 1]
        return active

    def match(self, tokens: list[int]) -> Node | None:
        """The deepest node with a continuation among the suffixes of ``tokens`` (at most
        ``max_depth``, longest first), or None."""
        for n in range(min(self.max_depth, len(tokens)), 0, -1):
            node = self.root
            for t in tokens[len(tokens) - n :]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.total > 0:
                return node
        return None


def best_child(node: Node) -> tuple[int, Node]:
    """The most frequent continuation (ties: the most recent)."""
    return max(node.children.items(), key=lambda item: (item[1].count, item[1].last))


def walk(
    trie: SuffixTrie,
    node: Node | None,
    context: list[int],
    num_tokens: int,
    min_token_prob: float,
    min_confidence: float,
) -> tuple[list[int], float, float]:
    """Greedy proposal from ``node`` (the match of ``context``): the tokens, the confidence (the
    running product of frequencies) and the score (the sum of running products)."""
    tokens: list[int] = []
    confidence, score = 1.0, 0.0
    while node is not None and len(tokens) < num_tokens:
        if node.total <= 0:  # the depth bound (or an evicted node): re-anchor on the tokens so far
            node = trie.match(context[-trie.max_depth :] + tokens)
            if node is None:
                break
        token, child = best_child(node)
        prob = child.count / node.total
        if prob < min_token_prob or confidence * prob < min_confidence:
            break
        confidence *= prob
        score += confidence
        tokens.append(token)
        node = child
    return tokens, confidence, score


@dataclass
class SlotState:
    """One cache slot's row: the history it has indexed, its trie and its active suffix nodes."""

    history: Tensor  # the tokens indexed so far (the last history seen)
    trie: SuffixTrie
    active: list[Node]  # in ``trie``
    global_active: list[Node | None]  # the same suffixes in the global trie (present ones only)
    first_len: int  # the history's length at the first proposal (prompt + first token)
    global_version: int = 0  # the global store's version ``global_active`` was found in


class SuffixDraft:
    """Implements :class:`tandem.models.base.Draft` without a model: needs ``DraftInput.history``.

    State lives on the draft, per cache slot (``batch.spans.slots``); the engine runs one draft
    per engine, so per-slot state is the row's state. ``last_confidence`` holds each row's
    confidence of the latest proposal (1.0 for an empty one)."""

    hidden_kind = None
    follows_constraint = False  # it copies tokens from the history; the verify masks judge them

    def __init__(
        self,
        max_depth: int = 32,
        min_token_prob: float = 0.1,
        min_confidence: float = 0.0,
        global_tokens: int = 0,
    ):
        if max_depth < 1:
            raise ValueError(f"the suffix draft needs max_depth >= 1, got {max_depth}")
        if not 0.0 <= min_token_prob <= 1.0 or not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"probability thresholds must lie in [0, 1], got {min_token_prob}, {min_confidence}")
        if global_tokens < 0:
            raise ValueError(f"global_tokens must be >= 0, got {global_tokens}")
        self.max_depth, self.min_token_prob, self.min_confidence = max_depth, min_token_prob, min_confidence
        self.global_tokens = global_tokens
        self.slots: dict[int, SlotState] = {}
        self.global_trie = SuffixTrie(max_depth)
        self.global_outputs: deque[list[int]] = deque()  # FIFO of the outputs in the global trie
        self.global_size = 0
        self.global_version = 0  # bumped whenever an output enters or leaves the global store
        self.last_confidence: list[float] = []

    def new_cache(self, num_slots: int, max_len: int) -> None:
        self.slots.clear()  # a new engine: nothing indexed yet
        return None

    # -- the per-slot index --------------------------------------------------------------------

    def _retire(self, state: SlotState) -> None:
        """A slot's request ended: its output enters the global store (bounded, FIFO)."""
        if self.global_tokens <= 0:
            return
        output = state.history[max(state.first_len - 1, 0) :].tolist()[-self.global_tokens :]
        if not output:
            return
        self.global_trie.extend([self.global_trie.root], output)
        self.global_outputs.append(output)
        self.global_size += len(output)
        self.global_version += 1
        while self.global_size > self.global_tokens:
            old = self.global_outputs.popleft()
            self.global_trie.remove([self.global_trie.root], old)
            self.global_size -= len(old)

    def update(self, slot: int, history: Tensor, start: int | None = None) -> SlotState:
        """Index ``history`` (the row's committed tokens) into ``slot``'s trie, incrementally when it
        extends the history indexed last; a new request (a shorter or different history, or
        ``start == 0``) resets the slot first."""
        history = history.cpu()
        state = self.slots.get(slot)
        if state is not None:
            seen = len(state.history)
            if start == 0 or len(history) < seen or not torch.equal(history[:seen], state.history):
                self._retire(state)
                state = None
        if state is None:
            trie = SuffixTrie(self.max_depth)
            state = SlotState(history[:0], trie, [trie.root], [self.global_trie.root], len(history), -1)
            self.slots[slot] = state
        new = history[len(state.history) :].tolist()
        if new:
            state.active = state.trie.extend(state.active, new)
        if self.global_tokens > 0:
            if state.global_version != self.global_version:  # the store changed: find the suffixes again
                recent = history[-self.max_depth :].tolist()
                state.global_active = self._follow_global([self.global_trie.root], recent)
                state.global_version = self.global_version
            elif new:
                state.global_active = self._follow_global(state.global_active, new)
        state.history = history
        return state

    def _follow_global(self, active: list[Node | None], tokens: list[int]) -> list[Node | None]:
        """The global trie's nodes of the row's suffixes (read only), after ``tokens``."""
        for t in tokens:
            new: list[Node | None] = [self.global_trie.root]
            for node in active[: self.max_depth]:  # lengths 0 .. max_depth - 1, extended by t
                child = node.children.get(t) if node is not None else None
                if child is None:
                    break  # a longer suffix is absent too
                new.append(child)
            active = new
        return active

    def propose_row(
        self, slot: int, history: Tensor, num_tokens: int, start: int | None = None
    ) -> tuple[list[int], float]:
        """Index the row's tokens, then propose up to ``num_tokens`` tokens and their confidence."""
        state = self.update(slot, history, start)
        context = state.history[-self.max_depth :].tolist()
        candidates = []
        for trie, active in ((state.trie, state.active), (self.global_trie, state.global_active)):
            if trie is self.global_trie and self.global_size == 0:
                continue
            node = next((n for n in reversed(active) if n is not None and n.total > 0), None)
            if node is not None and node is not trie.root:
                candidates.append(walk(trie, node, context, num_tokens, self.min_token_prob, self.min_confidence))
        if not candidates:
            return [], 1.0
        tokens, confidence, _ = max(candidates, key=lambda c: c[2])
        return tokens, confidence

    def propose(self, inp: DraftInput, cache: KVCache | None, num_tokens: int) -> DraftProposal:
        """``tokens: [B, num_tokens]`` on the batch's device; ``probs`` None (deterministic)."""
        if inp.history is None:
            raise ValueError("the suffix draft needs DraftInput.history (every row's committed token ids)")
        spans = inp.batch.spans
        out = torch.full((len(inp.history), num_tokens), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
        self.last_confidence = []
        for b, history in enumerate(inp.history):
            tokens, confidence = self.propose_row(spans.slots[b], history, num_tokens, spans.starts[b])
            out[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            self.last_confidence.append(confidence)
        return DraftProposal(tokens=to_device(out, inp.batch.input_ids.device), probs=None)


def build(config: SuffixConfig, weights: None, *, dtype: torch.dtype, device: torch.device, target=None) -> SuffixDraft:
    """The loading registry's builder for ``"suffix"``."""
    return SuffixDraft(config.max_depth, config.min_token_prob, config.min_confidence, config.global_tokens)
