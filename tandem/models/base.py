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

KV caches are paged: each layer is one pool of fixed-size blocks ``[num_blocks, block_size, ...]``,
and a :class:`BlockTable` says which blocks hold each slot's positions (a slot is a row index; a
target's cache and its draft's share one table, so one block id names both pools' entries). A
forward writes each token's entry at its position through its slot's table and attends causally
by position. :meth:`KVCache.truncate` only sets lengths (rollback after rejection, no copy);
re-running a position overwrites it, so decoding after a truncate equals decoding a fresh
cache over the same tokens. Which blocks a slot holds is the engine's business
(``tandem.engine.kv_blocks``); a cache built on its own (``new_cache(num_slots, max_len)``) gives
each slot one block of ``max_len`` positions, the contiguous layout. Layouts and cache checks read
Python ints on the host (``ForwardBatch.spans``, :class:`RowSpans`, ``KVCache.lengths`` and the
table's rows), never the device; ``truncate`` takes ints.

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

from tandem.core.transfer import Staging, int64_tensor
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

    def following(self) -> RowSpans:
        """One position per row, the one after each row's last (a chained draft's next step)."""
        return RowSpans(self.ends(), [1] * len(self.slots), self.slots)


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
    def build(
        cls,
        input_ids: Tensor,
        spans: RowSpans,
        *,
        logits_indices: Tensor | None = None,
        staging: Staging | None = None,
    ) -> ForwardBatch:
        """The batch of ``input_ids [T]`` laid out as ``spans`` (positions, offsets and slots follow on its device,
        in one copy; with ``staging``, in its copy, and the batch is read only once it has sent)."""
        if not (len(spans.starts) == len(spans.lengths) == len(spans.slots)):
            raise ValueError(f"starts, lengths and slots differ in length: {spans}")
        if sum(spans.lengths) != len(input_ids):
            raise ValueError(f"{len(input_ids)} input ids for rows of lengths {spans.lengths}")
        own = staging is None
        staging = Staging(input_ids.device) if own else staging
        positions = [s + i for s, n in zip(spans.starts, spans.lengths) for i in range(n)]
        batch = cls(
            input_ids=input_ids,
            positions=staging.int64(positions),
            row_offsets=staging.int64(spans.offsets()),
            slots=staging.int64(spans.slots),
            spans=spans,
            logits_indices=logits_indices,
        )
        if own:
            staging.send()
        return batch

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
        staging = Staging(device if device is not None else "cpu")  # one copy for the whole batch
        batch = cls.build(
            staging.int64([t for row in rows for t in row]),
            RowSpans(list(starts), [len(row) for row in rows], list(slots)),
            logits_indices=None if logits_indices is None else staging.int64(logits_indices),
            staging=staging,
        )
        staging.send()
        return batch

    def following(self, input_ids: Tensor) -> ForwardBatch:
        """One token per row, ``input_ids [B]``, at the position after each row's last (chained drafting).

        Positions are derived on the device, so chaining never waits for the device."""
        spans = self.spans.following()
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


class BlockTable:
    """Which pool blocks hold each slot's positions: position ``p`` of slot ``s`` is entry ``p % block_size`` of
    block ``rows[s][p // block_size]``, in every pool that shares the table (a target's and its draft's caches).

    ``rows`` (host lists) plan every forward (an eager forward's layout stages its rows' part of them);
    :attr:`tensor` ``[num_slots, max_blocks]`` int64 on the device is what graph mode's forwards read, one
    persistent buffer (its graphs read its address), refreshed by one copy when the rows changed (:meth:`sync`).
    Entries past a slot's blocks hold :attr:`scratch_block`, a block no real row owns: a gather past a row's
    blocks reads it (those keys are masked by position) and padding tokens write it. ``read_only[s]``: positions
    of slot ``s`` below it sit in blocks other rows share (a reused prefix); a forward that runs over them again
    (to recompute a hidden state) writes those entries to scratch instead, so a shared block is never written.
    """

    def __init__(
        self, num_slots: int, max_len: int, block_size: int, num_blocks: int, device=None, *, scratch_block: int = 0
    ):
        if block_size < 1 or not 0 <= scratch_block < num_blocks:
            raise ValueError(f"block_size {block_size} < 1 or scratch block {scratch_block} not among {num_blocks}")
        self.block_size, self.num_blocks, self.max_len = block_size, num_blocks, max_len
        self.scratch_block = scratch_block
        self.max_blocks = -(-max_len // block_size)
        self.rows: list[list[int]] = [[] for _ in range(num_slots)]
        self.read_only = [0] * num_slots
        self.tensor = torch.full((num_slots, self.max_blocks), scratch_block, dtype=torch.int64, device=device)
        self._dirty = False
        self.version = 0  # counts the changes to ``rows``: a parallel engine sends its workers the rows when it moved

    @classmethod
    def contiguous(cls, num_slots: int, max_len: int, device=None) -> BlockTable:
        """Slot ``s`` owns block ``s`` of ``max_len`` positions: the slot cache's layout. Nothing shares a block and
        no gather goes past a row's one block, so the scratch block is the last slot's: graph mode's padding
        slot, when a graph runner pads this cache."""
        table = cls(num_slots, max_len, max_len, num_slots, device, scratch_block=num_slots - 1)
        for slot in range(num_slots):
            table.set_blocks(slot, [slot])
        return table

    @property
    def num_slots(self) -> int:
        return len(self.rows)

    def capacity(self, slot: int) -> int:
        """Positions ``slot``'s blocks hold."""
        return len(self.rows[slot]) * self.block_size

    def set_blocks(self, slot: int, blocks: list[int], read_only: int = 0) -> None:
        """``slot`` holds ``blocks`` from now on; its first ``read_only`` positions are shared (never written)."""
        if len(blocks) > self.max_blocks:
            raise ValueError(f"slot {slot}: {len(blocks)} blocks exceed max_blocks {self.max_blocks}")
        self.rows[slot] = list(blocks)
        self.read_only[slot] = read_only
        self._dirty = True
        self.version += 1

    def sync(self, staging: Staging | None = None) -> Tensor:
        """:attr:`tensor` with the host rows copied in if they changed (one copy, no device read; with ``staging``,
        in its copy: the table is read only once it has sent)."""
        if self._dirty:
            pad = [self.scratch_block] * self.max_blocks
            flat = [b for row in self.rows for b in (row + pad)[: self.max_blocks]]
            if staging is None:
                self.tensor.copy_(int64_tensor(flat, self.tensor.device).view_as(self.tensor))
            else:
                staging.int64(flat, into=self.tensor)
            self._dirty = False
        return self.tensor

    def flat_index(self, slot: int, position: int) -> int:
        """Where ``slot``'s ``position`` is written in a pool flattened to ``[num_blocks * block_size, ...]``
        (a read-only position: the scratch block)."""
        offset = position % self.block_size
        if position < self.read_only[slot]:
            return self.scratch_block * self.block_size + offset
        return self.rows[slot][position // self.block_size] * self.block_size + offset


class KVCache:
    """Per-layer pools ``[num_blocks, block_size, *entry_shape]``, a :class:`BlockTable` and ``lengths``, one int
    per slot.

    What an entry holds is the model's business (Llama: stacked K and V ``[2, n_kv, head_dim]``;
    DeepSeek-V3: the compressed latent ``[kv_lora_rank + qk_rope_head_dim]``).
    ``lengths[s]`` is the number of positions of slot ``s`` that hold committed (or just written)
    entries; ``first_position`` is the lowest position a model ever writes (1 for drafts that pair
    a token with the hidden state before it, 0 otherwise).
    """

    def __init__(self, layers: list[Tensor], table: BlockTable, *, first_position: int = 0):
        if not layers:
            raise ValueError("a KVCache needs at least one layer tensor")
        shape = (table.num_blocks, table.block_size)
        for i, layer in enumerate(layers):
            if tuple(layer.shape[:2]) != shape:
                raise ValueError(f"layer {i} cache shape {tuple(layer.shape)} does not start with {shape}")
        self.layers, self.table = layers, table
        self.first_position = first_position
        self.lengths = [0] * table.num_slots  # host-side: the engine plans with these, the device never reads them
        # Layouts' addressing planned ahead in a step's staged copy (attention.RaggedLayout.stage), by their rows.
        self.planned: dict[tuple, object] = {}

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
        table: BlockTable | None = None,
    ) -> KVCache:
        """Zero-filled pools: ``num_layers`` tensors ``[num_blocks, block_size, *entry_shape]`` of ``table``'s
        blocks (None: :meth:`BlockTable.contiguous` over ``num_slots`` and ``max_len``)."""
        if table is None:
            table = BlockTable.contiguous(num_slots, max_len, device)
        shape = (table.num_blocks, table.block_size, *entry_shape)
        layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(layers, table, first_position=first_position)

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    @property
    def max_len(self) -> int:
        return self.table.max_len

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position takes across the layers (a block takes ``block_size`` times this)."""
        return sum(layer[0, 0].nbytes for layer in self.layers)

    def truncate(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Roll ``slots`` back to ``lengths`` positions each. Sets lengths only; copies nothing."""
        if any(not 0 <= n <= self.max_len for n in lengths):
            raise ValueError(f"truncate lengths {list(lengths)} outside [0, {self.max_len}]")
        for slot, n in zip(slots, lengths, strict=True):
            self.lengths[slot] = n

    def begin_forward(self, spans: RowSpans) -> None:
        """Check that a forward over ``spans`` (a batch's rows) fits and leaves no gap, then set each row's length
        to its last position + 1.

        Call once per forward, before writing. Raises ``ValueError`` naming the row when it has no
        tokens, names a slot that does not exist, ends past ``max_len`` or past its slot's blocks, or
        starts beyond what its slot holds.
        """
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
            if first + n > self.table.capacity(slot):
                raise ValueError(
                    f"row {b} (slot {slot}) writes up to position {first + n - 1} but its blocks hold "
                    f"{self.table.capacity(slot)} positions: grow the row first"
                )
        for slot, end in zip(spans.slots, spans.ends()):
            self.lengths[slot] = end


@dataclass
class TargetOutput:
    logits: Tensor  # [N, V] float32: logits at batch.logits_indices (all T tokens when None)
    hidden: Tensor | None = None  # [T, H]: last layer AFTER the final norm (EAGLE-1, MTP)
    aux_hidden: Tensor | None = None  # [T, len(aux_layer_ids) * H]: concat of the captured layer inputs (EAGLE-3)
    # [N] int64: each logits row's argmax below the tokenizer's ids, where the forward chose it (a graph's), else None
    greedy: Tensor | None = None


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
    dtype: torch.dtype  # of its activations and cache (its matmul weights may be stored narrower)
    aux_layer_ids: tuple[int, ...]  # settable: a draft's eagle_aux_hidden_state_layer_ids override the default

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> KVCache:
        """Its cache over ``table``'s blocks (None: one contiguous block per slot)."""
        ...

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


# (batch, hidden [T, *], cache, k, vocab_limit) -> [B, k] tokens, or None: `DraftInput.chain`.
ProposalChain = Callable[[ForwardBatch, Tensor, KVCache, int, int | None], Tensor | None]


@dataclass
class DraftInput:
    batch: ForwardBatch  # per row: the tokens committed since the last proposal, at their positions
    hidden: Tensor | None  # [T, Hd]: target hidden state at the position BEFORE each token
    history: list[Tensor] | None  # per row: all committed token ids [L_b] int64 (n-gram lookup)
    constraint: DraftConstraint | None = None  # grammar-aware drafting (None: propose freely)
    adjust: LogitAdjuster | None = None  # the rows' penalties and logit biases (None: the draft's own logits)
    vocab_limit: int | None = None  # ids from it up are never proposed (embedding rows past the tokenizer's)
    # How a chained draft runs each of its steps, ``(batch, hidden [T, *], cache) -> [T, H]``: None is the
    # draft's own eager ``step``; graph mode passes its runner's (``tandem.engine.graphs.GraphRunner.draft_step``).
    step: Callable[[ForwardBatch, Tensor, KVCache], Tensor] | None = None
    # A chained draft's whole greedy proposal, ``(batch, hidden [T, *], cache, k, vocab_limit) -> [B, k]`` or None
    # where it cannot: graph mode's one graph for every step (``GraphRunner.draft_chain``, over the draft's
    # ``target_logits``), for rows without constraint or adjustments (those choose each token on the host between
    # steps). None: step by step.
    chain: ProposalChain | None = None


@dataclass
class DraftProposal:
    tokens: Tensor  # [B, k] int64 target-vocabulary ids; -1 (PLACEHOLDER_TOKEN_ID) pads a shorter proposal
    probs: Tensor | None  # [B, k, V] float32 draft distribution over the TARGET vocab, or None (deterministic)


HiddenKind = Literal["last", "aux", None]


@runtime_checkable
class Draft(Protocol):
    """A draft model. ``hidden_kind`` says what it reads: the target's ``hidden`` ("last"), ``aux_hidden``
    ("aux"), or nothing (None). ``follows_constraint`` says whether ``propose`` reads
    ``DraftInput.constraint`` and ``DraftInput.adjust`` (drafts that copy tokens, like n-gram lookup, do not).
    tandem's drafts subclass it, for :meth:`release`'s default."""

    hidden_kind: HiddenKind
    follows_constraint: bool

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> KVCache | None:
        """Its cache over ``table``'s blocks, shared with the target's (None: one contiguous block per slot);
        None for a draft without one."""
        ...

    def propose(self, inp: DraftInput, cache: KVCache | None, num_tokens: int) -> DraftProposal:
        """Consume ``inp`` (writing its entries into ``cache``) and propose ``num_tokens`` tokens per row.

        Speculative entries written while chaining are overwritten by the next call (the
        caller truncates the cache to the committed length first).
        """
        ...

    def release(self, slot: int, tokens: list[int]) -> None:
        """Row ``slot`` finished with ``tokens`` (prompt and output): a draft that learns from finished rows keeps
        them (the suffix draft's store); others have nothing to do."""
