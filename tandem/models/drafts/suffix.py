"""Suffix draft: model-free proposals from a suffix trie of each row's tokens and of finished requests.

Like Arctic Inference's suffix decoding. Each cache slot keeps a depth-bounded suffix trie of its
row's tokens (prompt and output): node ``s`` (a string of at most ``max_depth`` tokens) holds, per
next token ``t``, how often ``s`` was followed by ``t``. The trie is updated incrementally: the
slot keeps its *active* nodes, those of the current sequence's suffixes of length
``0 .. max_depth`` that occurred before, and appending a token extends each of them by one child
(never a rebuild); strings seen once are lazy nodes pointing into the tokens (:class:`Node`). A new
request in a slot (its history no longer extends the one seen last, or a row starting at position
0) resets the slot.

Proposal: the longest suffix of the row's tokens with a recorded continuation (the deepest active
node with children), then greedily the most frequent next token (ties: the most recent), while
its empirical frequency ``count / total`` at that node stays at or above ``min_token_prob``; the
path's running product of these frequencies is the proposal's confidence, and it also stops
the walk when it falls below ``min_confidence``. A walk that reaches the depth bound re-anchors on
the longest suffix (of the tokens so far plus those proposed) found in the trie. Rows get fewer
than ``k`` tokens (padded with ``PLACEHOLDER_TOKEN_ID``) when the confidence drops.

A :class:`SuffixStore` (``SuffixDraft.store``; none by default, ``SuffixConfig.global_tokens`` sizes
one) adds what earlier requests wrote, matched by content, since an OpenAI-style server has no
conversation id (Arctic Inference's global tree): a bounded FIFO of finished requests' token
sequences (prompt and output; the engine hands each finished row over with
:meth:`SuffixDraft.release`) in one trie, whose oldest sequences leave it (their counts taken back)
once it holds more than its token or request limit. A row's proposal comes from its own trie or from
the store's, whichever scores higher (the expected accepted length: the sum of the running
products); the row's own wins ties. Agents repeat long spans of earlier tool output and answers,
which a row's own trie cannot know when they came in another request.

Host cost per step: per committed token, a dictionary step for each of its suffixes that occurred
before (at most ``max_depth + 1``; a few in text that does not repeat itself: see :class:`Node`),
plus ``O(k)`` dictionary walks for the proposal (``O(max_depth)`` more per re-anchor); the history
prefix check is one tensor comparison in C.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.core.transfer import to_device
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID
from tandem.models.base import BlockTable, Draft, DraftInput, DraftProposal, KVCache
from tandem.models.config import SuffixConfig


class Node:
    """A trie node: ``count`` = how often its string occurred (as its parent's string followed by its
    last token); ``total`` = how often its string was followed by any token (the sum of the
    children's counts); ``last`` = when it was last counted (ties go to the most recent); ``depth``
    = its string's length.

    A string seen once has no node of its own below the first one that occurred once: that *lazy*
    node (``children`` None) points at its occurrence instead, ``seq[pos]`` being its continuation
    (if ``seq`` has one yet), and the nodes below it are implied by the tokens after it
    (:meth:`SuffixTrie.child` makes them on reading). Most strings of a text longer than a few tokens
    occur once, so a token costs dictionary steps only for its suffixes that occurred before, not for
    all ``max_depth`` of them. A second occurrence turns a lazy node into an ordinary one
    (:meth:`SuffixTrie.split`)."""

    __slots__ = ("children", "count", "total", "last", "depth", "seq", "pos")

    def __init__(self, depth: int = 0, seq: list[int] | None = None, pos: int = 0, last: int = 0) -> None:
        self.children: dict[int, Node] | None = None if seq is not None else {}
        self.count = 0 if seq is None else 1
        self.total = 0
        self.last = last
        self.depth, self.seq, self.pos = depth, seq, pos


class SuffixTrie:
    """A depth-bounded suffix trie over one or more token sequences, with incremental appends.

    It holds the strings of up to ``max_depth + 1`` tokens (a context of up to ``max_depth`` and its
    continuation) of the sequences given to :meth:`extend`; lazy nodes point into those lists, which
    callers only ever append to.
    """

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = Node()
        self.clock = 0  # a counter for recency: one tick per indexed token

    def extend(self, active: list[Node], seq: list[int], start: int) -> list[Node]:
        """Index ``seq[start:]`` after ``seq[:start]``, whose suffixes that occurred before have the
        ordinary nodes ``active`` (``active[j]``: the suffix of length j; ``[root]`` when ``start`` is
        0); returns the new ``active``."""
        depth, root, clock = self.max_depth, self.root, self.clock
        for e in range(start, len(seq)):  # the hot loop: a few dictionary steps per token
            t = seq[e]
            clock += 1
            new = [root]
            for node in active:  # suffixes seen before, of length 0 .. depth: their continuations by t
                node.total += 1
                child = node.children.get(t)
                if child is None:  # a first occurrence (and so are the longer suffixes'): lazy nodes
                    node.children[t] = Node(node.depth + 1, seq, e + 1, clock)
                    continue
                if child.children is None:
                    self.split(child)
                child.count += 1
                child.last = clock
                new.append(child)
            if len(new) > depth + 1:  # strings of length depth + 1 only count continuations
                new.pop()
            active = new
        self.clock = clock
        return active

    def split(self, node: Node) -> None:
        """Make lazy ``node`` ordinary (its string occurs again): its one occurrence's continuation
        becomes a lazy child."""
        seq, pos = node.seq, node.pos
        node.children, node.seq = {}, None
        if pos < len(seq) and node.depth <= self.max_depth:
            node.children[seq[pos]] = Node(node.depth + 1, seq, pos + 1, node.last + 1)
            node.total = 1

    def remove(self, seq: list[int]) -> None:
        """Take back the counts of ``extend([root], seq, 0)``, pruning nodes whose count drops to 0."""
        for i in range(len(seq)):
            node = self.root
            for t in seq[i : i + self.max_depth + 1]:  # the strings starting at i
                node.total -= 1
                child = node.children[t]
                if child.children is None or child.count == 1:  # this occurrence was its only one
                    del node.children[t]
                    break
                child.count -= 1
                node = child

    def total(self, node: Node) -> int:
        """How often ``node``'s string was followed by a token."""
        if node.children is not None:
            return node.total
        return int(node.pos < len(node.seq) and node.depth <= self.max_depth)

    def children(self, node: Node) -> list[tuple[int, Node]]:
        """``node``'s continuations and their nodes (a lazy node's one, made on reading)."""
        if node.children is not None:
            return list(node.children.items())
        if not self.total(node):
            return []
        return [(node.seq[node.pos], Node(node.depth + 1, node.seq, node.pos + 1, node.last + 1))]

    def child(self, node: Node, token: int) -> Node | None:
        """The node of ``node``'s string followed by ``token``, or None if that never occurred."""
        if node.children is not None:
            return node.children.get(token)
        return next((child for t, child in self.children(node) if t == token), None)

    def match(self, tokens: list[int]) -> Node | None:
        """The deepest node with a continuation among the suffixes of ``tokens`` (at most
        ``max_depth``, longest first), or None."""
        for n in range(min(self.max_depth, len(tokens)), 0, -1):
            node = self.root
            for t in tokens[len(tokens) - n :]:
                node = self.child(node, t)
                if node is None:
                    break
            if node is not None and self.total(node) > 0:
                return node
        return None

    def best_child(self, node: Node) -> tuple[int, Node]:
        """The most frequent continuation (ties: the most recent)."""
        return max(self.children(node), key=lambda item: (item[1].count, item[1].last))


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
        total = trie.total(node)
        if total <= 0:  # the depth bound (or an evicted node): re-anchor on the tokens so far
            node = trie.match(context[-trie.max_depth :] + tokens)
            if node is None:
                break
            total = trie.total(node)
        token, child = trie.best_child(node)
        prob = child.count / total
        if prob < min_token_prob or confidence * prob < min_confidence:
            break
        confidence *= prob
        score += confidence
        tokens.append(token)
        node = child
    return tokens, confidence, score


class SuffixStore:
    """A bounded store of finished requests' token sequences in one suffix trie, shared by every row
    (and by every draft it is given to).

    Holds at most ``max_tokens`` tokens (a longer sequence keeps its last ``max_tokens``) and at most
    ``max_requests`` sequences (None: no count limit); adding past either limit evicts the oldest
    sequences first (FIFO), taking their counts back exactly. ``version`` changes whenever the
    contents do, so readers know when the nodes they hold may have left the trie.
    """

    def __init__(self, max_tokens: int, max_requests: int | None = None, max_depth: int = 32):
        if max_tokens < 1 or (max_requests is not None and max_requests < 1):
            raise ValueError(
                f"a suffix store needs max_tokens >= 1 and max_requests >= 1, got {max_tokens}, {max_requests}"
            )
        self.max_tokens, self.max_requests = max_tokens, max_requests
        self.trie = SuffixTrie(max_depth)
        self.sequences: deque[list[int]] = deque()  # oldest first
        self.size = 0  # tokens held
        self.version = 0

    def add(self, tokens: list[int]) -> None:
        """Index one finished request's tokens, evicting the oldest sequences past the limits."""
        tokens = tokens[-self.max_tokens :]
        if not tokens:
            return
        self.trie.extend([self.trie.root], tokens, 0)
        self.sequences.append(tokens)
        self.size += len(tokens)
        while self.size > self.max_tokens or (
            self.max_requests is not None and len(self.sequences) > self.max_requests
        ):
            old = self.sequences.popleft()
            self.trie.remove(old)
            self.size -= len(old)
        self.version += 1

    def follow(self, active: list[Node | None], tokens: list[int]) -> list[Node | None]:
        """The store's nodes of a sequence's suffixes (read only; ``active`` as in
        :meth:`SuffixTrie.extend`, present ones only) after appending ``tokens``."""
        trie = self.trie
        for t in tokens:
            new: list[Node | None] = [trie.root]
            for node in active[: trie.max_depth]:  # lengths 0 .. depth - 1, extended by t
                child = trie.child(node, t) if node is not None else None
                if child is None:
                    break  # a longer suffix is absent too
                new.append(child)
            active = new
        return active


@dataclass
class SlotState:
    """One cache slot's row: the history it has indexed, its trie and its active suffix nodes."""

    history: Tensor  # the tokens indexed so far (the last history seen)
    tokens: list[int]  # the same, the list ``trie``'s lazy nodes point into
    trie: SuffixTrie
    active: list[Node]  # in ``trie``
    store_active: list[Node | None]  # the same suffixes in the store's trie (present ones only)
    store_version: int = -1  # the store's version ``store_active`` was found in


class SuffixDraft(Draft):
    """Implements :class:`tandem.models.base.Draft` without a model: needs ``DraftInput.history``.

    State lives on the draft, per cache slot (``batch.spans.slots``); the engine runs one draft
    per engine, so per-slot state is the row's state. ``last_confidence`` holds each row's
    confidence of the latest proposal (1.0 for an empty one). ``store``: the
    :class:`SuffixStore` finished rows go into and proposals also draw on (None: none); set it, or
    share one store between drafts, at any time."""

    hidden_kind = None
    follows_constraint = False  # it copies tokens from the history; the verify masks judge them

    def __init__(
        self,
        max_depth: int = 32,
        min_token_prob: float = 0.1,
        min_confidence: float = 0.0,
        store: SuffixStore | None = None,
    ):
        if max_depth < 1:
            raise ValueError(f"the suffix draft needs max_depth >= 1, got {max_depth}")
        if not 0.0 <= min_token_prob <= 1.0 or not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"probability thresholds must lie in [0, 1], got {min_token_prob}, {min_confidence}")
        self.max_depth, self.min_token_prob, self.min_confidence = max_depth, min_token_prob, min_confidence
        self.store = store
        self.slots: dict[int, SlotState] = {}
        self.last_confidence: list[float] = []

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> None:
        self.slots.clear()  # a new engine: nothing indexed yet
        return None

    # -- the per-slot index --------------------------------------------------------------------

    def release(self, slot: int, tokens: list[int]) -> None:
        """The row in ``slot`` finished with ``tokens`` (prompt and output): they enter the store, if
        there is one, and the slot's index is dropped (the engine calls this as the row leaves)."""
        self.slots.pop(slot, None)
        if self.store is not None:
            self.store.add(list(tokens))

    def update(self, slot: int, history: Tensor, start: int | None = None) -> SlotState:
        """Index ``history`` (the row's committed tokens) into ``slot``'s trie, incrementally when it
        extends the history indexed last; a new request (a shorter or different history, or
        ``start == 0``) resets the slot first."""
        history = history.cpu()
        state = self.slots.get(slot)
        if state is not None:
            seen = len(state.history)
            if start == 0 or len(history) < seen or not torch.equal(history[:seen], state.history):
                state = None
        if state is None:
            trie = SuffixTrie(self.max_depth)
            state = SlotState(history[:0], [], trie, [trie.root], [])
            self.slots[slot] = state
        new = history[len(state.history) :].tolist()
        if new:
            state.tokens.extend(new)
            state.active = state.trie.extend(state.active, state.tokens, len(state.tokens) - len(new))
        store = self.store
        if store is not None:
            if state.store_version != store.version:  # the store changed: find the suffixes again
                recent = history[-store.trie.max_depth :].tolist()
                state.store_active = store.follow([store.trie.root], recent)
                state.store_version = store.version
            elif new:
                state.store_active = store.follow(state.store_active, new)
        state.history = history
        return state

    def propose_row(
        self, slot: int, history: Tensor, num_tokens: int, start: int | None = None
    ) -> tuple[list[int], float]:
        """Index the row's tokens, then propose up to ``num_tokens`` tokens and their confidence."""
        state = self.update(slot, history, start)
        context = state.history[-self.max_depth :].tolist()
        sources = [(state.trie, state.active)]
        if self.store is not None:
            sources.append((self.store.trie, state.store_active))
        candidates = []  # the row's own first: max() keeps the first of equal scores
        for trie, active in sources:
            node = next((n for n in reversed(active) if n is not None and trie.total(n) > 0), None)
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
    store = SuffixStore(config.global_tokens, max_depth=config.max_depth) if config.global_tokens > 0 else None
    return SuffixDraft(config.max_depth, config.min_token_prob, config.min_confidence, store)
