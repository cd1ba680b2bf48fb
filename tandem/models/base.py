"""The provider contract: ragged batches, KV caches with rollback, and the Target / Draft protocols.

A **target** verifies a ragged batch (no padding): row ``b`` owns tokens
``row_offsets[b]:row_offsets[b+1]`` of the concatenated ``input_ids``, each at its absolute
``positions`` in the sequence kept in KV-cache slot ``slots[b]``. It returns logits for the
tokens named by ``logits_indices`` plus, on request, the hidden states a draft reads.

A **draft** proposes ``k`` tokens per row from the tokens committed since its last proposal
and the target's hidden state at the position *before* each of them: the pair
``(h_{p-1}, x_p)`` predicts ``x_{p+1}`` (EAGLE/MTP pairing). Hidden-reading drafts keep that
pair at cache position ``p``; position 0 has no pair (:attr:`KVCache.first_position` = 1).

Drafts that choose their tokens (EAGLE, EAGLE-3, MTP; ``Draft.follows_constraint``) choose under
the row's rules: among the tokens its grammar allows (``DraftInput.constraint``,
:class:`DraftConstraint`), and on logits with its penalties and logit biases applied
(``DraftInput.adjust``, :class:`LogitAdjuster`), so a penalised row's drafts still match its target.

KV caches are preallocated, ``[num_slots, max_len, ...]`` per layer, plus host-side ``lengths``.
A forward writes each token's entry at its position in its slot and attends causally by
position. :meth:`KVCache.truncate` only sets lengths (rollback after rejection, no copy);
re-running a position overwrites it, so decoding after a truncate equals decoding a fresh
cache over the same tokens. Layouts and cache checks read Python ints on the host
(``ForwardBatch.spans``, :class:`RowSpans`, and ``KVCache.lengths``), never the device;
``truncate``/``reset`` take ints.

Aux hidden states (EAGLE-3) use the HF ``hidden_states`` index convention: index ``i`` is the
input of decoder layer ``i`` (before any final norm); the default capture points are
``(2, L // 2, L - 3)`` like the published EAGLE-3 drafts (:func:`default_aux_layer_ids`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from tandem.core.transfer import int64_tensor
from tandem.models.config import TargetConfig


@dataclass(frozen=True)
class RowSpans:
    """A batch's rows on the host: row ``b`` holds positions ``starts[b] .. starts[b] + lengths[b] - 1``
    of cache slot ``slots[b]``. Layouts and cache checks are planned from these Python ints, so a
    forward never reads the device back (vLLM keeps ``*_cpu`` twins of its metadata for the same reason)."""

    starts: list[int]
    lengths: list[int]
    slots: list[int]

    def ends(self) -> list[int]:
        """One past each row's last position."""
        return [s + n for s, n in zip(self.starts, self.lengths)]

    def offsets(self) -> list[int]:
        """``[B+1]``: row b owns tokens ``offsets[b]:offsets[b+1]`` of the concatenated batch."""
        return list(itertools.accumulate(self.lengths, initial=0))


@dataclass
class ForwardBatch:
    """A ragged batch, no padding: int64 tensors on the model's device, and :class:`RowSpans`, the same
    rows on the host. Build it with :meth:`build`, :meth:`from_rows` or :meth:`following`, which keep the two
    in step."""

    input_ids: Tensor  # [T]: every row's new tokens, concatenated
    positions: Tensor  # [T]: absolute position of each token in its sequence
    row_offsets: Tensor  # [B+1]: row b owns tokens row_offsets[b]:row_offsets[b+1]
    slots: Tensor  # [B]: KV-cache slot of each row
    spans: RowSpans  # the rows' starts, lengths and slots as Python ints
    logits_indices: Tensor | None = None  # [N] indices into T whose logits are wanted (None = all)

    @property
    def num_rows(self) -> int:
        return len(self.spans.slots)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def build(cls, input_ids: Tensor, spans: RowSpans, *, logits_indices: Tensor | None = None) -> ForwardBatch:
        """The batch of ``input_ids [T]`` laid out as ``spans`` (positions, offsets and slots follow on its device)."""
        if not (len(spans.starts) == len(spans.lengths) == len(spans.slots)):
            raise ValueError(f"starts, lengths and slots differ in length: {spans}")
        if sum(spans.lengths) != len(input_ids):
            raise ValueError(f"{len(input_ids)} input ids for rows of lengths {spans.lengths}")
        device = input_ids.device
        positions = [s + i for s, n in zip(spans.starts, spans.lengths) for i in range(n)]
        return cls(
            input_ids=input_ids,
            positions=int64_tensor(positions, device),
            row_offsets=int64_tensor(spans.offsets(), device),
            slots=int64_tensor(spans.slots, device),
            spans=spans,
            logits_indices=logits_indices,
        )

    @classmethod
    def from_rows(
        cls,
        rows: list[list[int]],
        starts: list[int],
        slots: list[int],
        *,
        logits_indices: list[int] | None = None,
        device: torch.device | str | None = None,
    ) -> ForwardBatch:
        """Build a batch from per-row token lists ``rows[b]`` placed at ``starts[b], starts[b]+1, ...``."""
        if not (len(rows) == len(starts) == len(slots)):
            raise ValueError(f"rows, starts and slots differ in length: {len(rows)}, {len(starts)}, {len(slots)}")
        return cls.build(
            int64_tensor([t for row in rows for t in row], device),
            RowSpans(list(starts), [len(row) for row in rows], list(slots)),
            logits_indices=None if logits_indices is None else int64_tensor(logits_indices, device),
        )

    def following(self, input_ids: Tensor) -> ForwardBatch:
        """One token per row, ``input_ids [B]``, at the position after each row's last (chained drafting).

        Positions are derived on the device, so chaining never waits for the device."""
        spans = RowSpans(self.spans.ends(), [1] * self.num_rows, self.spans.slots)
        if self.num_tokens == self.num_rows:  # one token per row already: the same offsets, arange(B + 1)
            last_positions, offsets = self.positions, self.row_offsets
        else:
            last_positions = self.positions[self.last_token_indices()]
            offsets = torch.arange(self.num_rows + 1, device=self.positions.device)
        return ForwardBatch(input_ids, last_positions + 1, offsets, self.slots, spans)

    def last_token_indices(self) -> Tensor:
        """``[B]`` int64: index into T of each row's last token."""
        return self.row_offsets[1:] - 1

    def token_rows(self) -> Tensor:
        """``[T]`` int64: the row of each token."""
        rows = torch.arange(self.num_rows, device=self.slots.device)
        return rows.repeat_interleave(self.row_offsets.diff(), output_size=self.num_tokens)  # sized: no device read


class KVCache:
    """Preallocated per-layer caches ``[num_slots, max_len, *entry_shape]`` and ``lengths``, one int per slot.

    What an entry holds is the model's business (Llama: stacked K and V ``[2, n_kv, head_dim]``;
    DeepSeek-V3: the compressed latent ``[kv_lora_rank + qk_rope_head_dim]``).
    ``lengths[s]`` is the number of positions of slot ``s`` that hold committed (or just written)
    entries; ``first_position`` is the lowest position a model ever writes (1 for drafts that pair
    a token with the hidden state before it, 0 otherwise).
    """

    def __init__(self, layers: list[Tensor], *, first_position: int = 0):
        if not layers:
            raise ValueError("a KVCache needs at least one layer tensor")
        shape = layers[0].shape[:2]
        for i, layer in enumerate(layers):
            if layer.shape[:2] != shape:
                raise ValueError(f"layer {i} cache shape {tuple(layer.shape)} does not start with {tuple(shape)}")
        self.layers = layers
        self.first_position = first_position
        self.lengths = [0] * shape[0]  # host-side: the engine plans with these, the device never reads them

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_slots: int,
        max_len: int,
        entry_shape: tuple[int, ...],
        *,
        dtype: torch.dtype,
        device: torch.device | str | None,
        first_position: int = 0,
    ) -> KVCache:
        """Zero-filled caches: ``num_layers`` tensors ``[num_slots, max_len, *entry_shape]``."""
        layers = [torch.zeros(num_slots, max_len, *entry_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(layers, first_position=first_position)

    @property
    def num_slots(self) -> int:
        return self.layers[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.layers[0].shape[1]

    def truncate(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Roll ``slots`` back to ``lengths`` positions each. Sets lengths only; copies nothing."""
        if any(not 0 <= n <= self.max_len for n in lengths):
            raise ValueError(f"truncate lengths {list(lengths)} outside [0, {self.max_len}]")
        for slot, n in zip(slots, lengths, strict=True):
            self.lengths[slot] = n

    def reset(self, slots: Sequence[int]) -> None:
        """Empty ``slots`` (a new sequence will use them)."""
        self.truncate(slots, [0] * len(slots))

    def begin_forward(self, batch: ForwardBatch) -> None:
        """Check that ``batch`` fits and leaves no gap, then set each row's length to its last position + 1.

        Call once per forward, before writing. Raises ``ValueError`` naming the row when it has no
        tokens, names a slot that does not exist, ends past ``max_len`` or starts beyond what its
        slot holds. Reads only the batch's host-side :class:`RowSpans`.
        """
        spans = batch.spans
        for b, (slot, first, n) in enumerate(zip(spans.slots, spans.starts, spans.lengths)):
            if n <= 0:
                raise ValueError(f"row {b} has no tokens (lengths {spans.lengths}); every row needs at least one")
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"row {b} names slot {slot}, outside [0, {self.num_slots})")
            held = max(self.lengths[slot], self.first_position)
            if first + n > self.max_len or first > held or first < self.first_position:
                raise ValueError(
                    f"row {b} (slot {slot}) writes positions {first}..{first + n - 1} but the slot holds {held} "
                    f"positions, writes start at {self.first_position} and max_len is {self.max_len}"
                )
        for slot, end in zip(spans.slots, spans.ends()):
            self.lengths[slot] = end


@dataclass
class TargetOutput:
    logits: Tensor  # [N, V] float32: logits at batch.logits_indices (all T tokens when None)
    hidden: Tensor | None = None  # [T, H]: last layer AFTER the final norm (EAGLE-1, MTP)
    aux_hidden: Tensor | None = None  # [T, len(aux_layer_ids) * H]: concat of the captured layer inputs (EAGLE-3)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's capture points in the HF ``hidden_states`` convention (index i = input of layer i)."""
    return (2, num_layers // 2, num_layers - 3) if num_layers >= 5 else (1, num_layers // 2, num_layers - 1)


@runtime_checkable
class Target(Protocol):
    """A target model. ``config`` is its typed config (:mod:`tandem.models.config`); ``checkpoint_dir`` is set
    by ``load_target``."""

    config: TargetConfig
    checkpoint_dir: Path | None
    vocab_size: int
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]  # settable: a draft's eagle_aux_hidden_state_layer_ids override the default

    def new_cache(self, num_slots: int, max_len: int) -> KVCache: ...

    def forward(
        self, batch: ForwardBatch, cache: KVCache, *, return_hidden: bool = False, return_aux: bool = False
    ) -> TargetOutput:
        """Write the batch's K/V into ``cache`` and return its logits (and hidden states on request)."""
        ...

    def embed(self, ids: Tensor) -> Tensor:
        """``ids: [T] int64`` -> ``[T, H]`` token embeddings (shared with drafts)."""
        ...

    def lm_head(self, hidden: Tensor) -> Tensor:
        """``hidden: [N, H]`` -> ``[N, V]`` float32 logits (shared with drafts; no final norm applied)."""
        ...


class DraftConstraint(Protocol):
    """Grammar-aware drafting: what each row may propose at each chained position.

    A draft that chooses its tokens calls :meth:`allowed` before choosing token i and
    :meth:`advance` with its choice after (for every i < k, the last one included). Drafts are
    still verified by the target; this only spares proposals the target's grammar mask rejects.
    """

    def allowed(self) -> Tensor:
        """``[B, V]`` bool on the draft's device: the tokens allowed at the current position."""
        ...

    def advance(self, tokens: Tensor) -> None:
        """``tokens: [B] int64``: the tokens just proposed at the current position."""
        ...


class LogitAdjuster(Protocol):
    """The rows' penalties and logit biases, applied to a draft's logits before each choice, as the
    target's verify positions will apply them (``decoding.penalties``)."""

    def __call__(self, logits: Tensor, proposed: Tensor) -> Tensor:
        """``logits [B, V]`` over the target vocabulary at the position after ``proposed [B, i]``
        (this proposal's tokens so far) -> adjusted ``[B, V]`` float32."""
        ...


@dataclass
class DraftInput:
    batch: ForwardBatch  # per row: the tokens committed since the last proposal, at their positions
    hidden: Tensor | None  # [T, Hd]: target hidden state at the position BEFORE each token
    history: list[Tensor] | None  # per row: all committed token ids [L_b] int64 (n-gram lookup)
    constraint: DraftConstraint | None = None  # grammar-aware drafting (None: propose freely)
    adjust: LogitAdjuster | None = None  # the rows' penalties and logit biases (None: the draft's own logits)
    # How a chained draft runs each of its steps, ``(batch, hidden [T, *], cache) -> [T, H]``: None is the
    # draft's own eager ``step``; graph mode passes its runner's (``tandem.engine.graphs.GraphRunner.draft_step``).
    step: Callable[[ForwardBatch, Tensor, KVCache], Tensor] | None = None


@dataclass
class DraftProposal:
    tokens: Tensor  # [B, k] int64 target-vocabulary ids; -1 (PLACEHOLDER_TOKEN_ID) pads a shorter proposal
    probs: Tensor | None  # [B, k, V] float32 draft distribution over the TARGET vocab, or None (deterministic)


HiddenKind = Literal["last", "aux", None]


@runtime_checkable
class Draft(Protocol):
    """A draft model. ``hidden_kind`` says what it reads: the target's ``hidden`` ("last"), ``aux_hidden``
    ("aux"), or nothing (None). ``follows_constraint`` says whether ``propose`` reads
    ``DraftInput.constraint`` and ``DraftInput.adjust`` (drafts that copy tokens, like n-gram lookup, do not)."""

    hidden_kind: HiddenKind
    follows_constraint: bool

    def new_cache(self, num_slots: int, max_len: int) -> KVCache | None: ...

    def propose(self, inp: DraftInput, cache: KVCache | None, num_tokens: int) -> DraftProposal:
        """Consume ``inp`` (writing its entries into ``cache``) and propose ``num_tokens`` tokens per row.

        Speculative entries written while chaining are overwritten by the next call (the
        caller truncates the cache to the committed length first).
        """
        ...
