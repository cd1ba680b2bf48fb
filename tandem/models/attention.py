"""Attention over a ragged batch and a KV cache: where each token's entry lives, and what each query sees.

:class:`RaggedLayout` is built once per forward from the batch's host-side spans and shared by
every layer of every provider (the Llama and DeepSeek targets, the EAGLE, EAGLE-3 and MTP drafts).
It keeps two concerns apart:

- **Addressing** (:class:`SlotAddressing`, ``layout.addressing``): where a token's cache entry is
  written (:meth:`~SlotAddressing.write`) and how a row's keys are read
  (:meth:`~SlotAddressing.gather`: ``[B, num_keys, ...]``, key ``j`` at position ``key_start + j``).
  Today each row owns a cache slot, ``cache[slot, position]``. This is the one seam the cache's
  layout goes through: a paged KV cache replaces it with an addressing that writes and gathers
  through block tables, and graph mode (:meth:`RaggedLayout.static`) with one that scatters every
  write and gathers one key window for every row; the providers keep calling ``write`` and ``gather``.
- **Visibility**: queries sit in a padded ``[B, Qmax]`` grid (:meth:`RaggedLayout.to_grid`) and
  see the gathered keys whose position is at most theirs (:attr:`RaggedLayout.visible`, none for
  one token per row at each row's end); one ``scaled_dot_product_attention`` call runs with that
  mask. The mask is built over the addressing's key window, so a mode whose gather returns whole
  slots gets a mask over whole slots (masking by the rows' lengths instead of slicing) and a
  fixed ``[B_bucket, Qmax]`` grid, without changes to the providers.

The common cases copy nothing: when every row has the same number of tokens (decode and verify
steps) the grid is a view of the tokens, when the rows' slots are consecutive their keys are a
view of the cache, and one row's tokens are written as a slice of its slot. Keys start at
``key_start`` (a draft's cache holds nothing at position 0), so a step of one token per row at
each row's end needs no mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.models.base import ForwardBatch


@dataclass
class SlotAddressing:
    """Where a slot cache holds the batch's entries: row ``b``'s position ``p`` is ``cache[slots[b], p]``,
    for caches ``[num_slots, max_len, ...]``; keys are read for positions ``key_start .. key_end - 1``."""

    token_slots: Tensor  # [T] int64: cache slot of each token
    positions: Tensor  # [T] int64: position of each token
    one_row: tuple[int, int] | None  # (slot, first position) when the batch is one row, else None
    slots: Tensor  # [B] int64: each row's slot
    first_slot: int | None  # slots == first_slot + arange(B), or None (the keys are gathered)
    key_start: int  # position of the first key
    key_end: int  # one past the position of the last key

    @property
    def num_keys(self) -> int:
        return self.key_end - self.key_start

    def write(self, cache: Tensor, entries: Tensor) -> None:
        """Store ``entries [T, ...]`` at each token's slot and position of ``cache [slots, max_len, ...]``.

        One row's tokens fill a slice of its slot: a copy, cheaper than the scatter to (slot,
        position) indices, and it runs in every layer.
        """
        if self.one_row is None:
            cache[self.token_slots, self.positions] = entries.to(cache.dtype)
        else:
            slot, start = self.one_row
            cache[slot, start : start + entries.shape[0]] = entries

    def gather(self, cache: Tensor) -> Tensor:
        """The rows' keys: ``cache [slots, max_len, ...]`` -> ``[B, num_keys, ...]``, a view of the cache when
        the rows' slots are consecutive."""
        if self.first_slot is not None:
            return cache[self.first_slot : self.first_slot + self.slots.shape[0], self.key_start : self.key_end]
        return cache[:, self.key_start : self.key_end].index_select(0, self.slots)


@dataclass
class RaggedLayout:
    """Where each token of a ragged batch sits in a padded ``[B, Qmax]`` query grid, what it sees, and
    where its cache entry lives (:attr:`addressing`). Built once per forward by :meth:`build`."""

    addressing: SlotAddressing
    num_rows: int
    grid_index: tuple[Tensor, Tensor] | None  # (row, column) [T] of each token in the grid; None: T == B * Qmax
    visible: Tensor | None  # [B, 1, Qmax, num_keys] bool: key position <= query position
    #                         (None when every query sees every key)
    max_query: int
    max_key: int  # one past the last position of the batch
    _masks: dict[tuple, Tensor] = field(default_factory=dict, repr=False)  # attention_mask's, per (dtype, repeats)

    @classmethod
    def build(cls, batch: ForwardBatch, first_position: int = 0) -> RaggedLayout:
        """The layout of ``batch`` over a slot cache whose entries start at ``first_position``."""
        spans = batch.spans
        num_rows, num_tokens = batch.num_rows, batch.num_tokens
        ends = spans.ends()
        max_query, max_key = max(spans.lengths), max(ends)
        if num_tokens == num_rows * max_query:
            grid_index = None
            query_positions = batch.positions.view(num_rows, max_query)
            token_slots = batch.slots.repeat_interleave(max_query) if max_query > 1 else batch.slots
        else:
            token_rows = batch.token_rows()
            grid_index = token_rows, torch.arange(num_tokens, device=token_rows.device) - batch.row_offsets[token_rows]
            # Padding queries see every key: their outputs are dropped, and no softmax row is empty.
            query_positions = batch.positions.new_full((num_rows, max_query), max_key - 1)
            query_positions[grid_index] = batch.positions
            token_slots = batch.slots[token_rows]
        slots = spans.slots
        addressing = SlotAddressing(
            token_slots,
            batch.positions,
            one_row=(slots[0], spans.starts[0]) if num_rows == 1 else None,
            slots=batch.slots,
            first_slot=slots[0] if slots == list(range(slots[0], slots[0] + num_rows)) else None,
            key_start=first_position,
            key_end=max_key,
        )
        visible = None
        if max_query > 1 or min(ends) < addressing.key_end:
            keys = torch.arange(addressing.key_start, addressing.key_end, device=batch.positions.device)
            visible = (keys <= query_positions[..., None])[:, None]
        return cls(addressing, num_rows, grid_index, visible, max_query, max_key)

    @classmethod
    def static(
        cls, positions: Tensor, write_slots: Tensor, slots: Tensor, key_start: int, num_keys: int
    ) -> RaggedLayout:
        """The layout of a fixed grid of ``B`` rows by ``Q`` tokens (graph mode), built from device tensors only.

        Args:
            positions: ``[B, Q]`` int64, each token's position; a padding token takes a position its row's
                slot already holds (the row's last), so its query sees real keys and no softmax row is empty.
            write_slots: ``[B * Q]`` int64, the slot each token's entry is written to: padding tokens write to a
                scratch slot that no real row reads, so they never overwrite a real row's entries.
            slots: ``[B]`` int64, the slot each row's queries read (a padding row: the scratch slot).
            key_start, num_keys: every row reads keys ``key_start .. key_start + num_keys - 1``: a CUDA graph
                the whole slot; a compiled CPU step the window its rows reach (``num_keys`` a dynamic size).

        Every write is a scatter and every row gathers the same key window, masked by position (key
        position <= query position) instead of sliced by the rows' lengths: nothing depends on a value
        read from the batch, so the layout's ops compile into one graph per ``(B, Q)``.
        """
        num_rows, max_query = positions.shape
        key_end = key_start + num_keys
        addressing = SlotAddressing(
            write_slots, positions.flatten(), None, slots, first_slot=None, key_start=key_start, key_end=key_end
        )
        keys = torch.arange(key_start, key_end, device=positions.device)
        visible = (keys <= positions[..., None])[:, None]
        return cls(addressing, num_rows, None, visible, max_query, key_end)

    def attention_mask(self, dtype: torch.dtype, repeats: int = 1) -> Tensor | None:
        """``visible`` as ``scaled_dot_product_attention``'s additive mask (0 or -inf) in ``dtype``,
        ``[B, 1, Qmax * repeats, num_keys]`` with each query's row repeated ``repeats`` times (MLA
        folds its heads into the query axis); None when every query sees every key.

        Built by the first layer that asks and kept for the others: sdpa would convert a bool mask,
        and MLA expand it, in every layer.
        """
        if self.visible is None:
            return None
        if (dtype, repeats) not in self._masks:
            visible = self.visible
            if repeats > 1:
                visible = visible[..., None, :].expand(-1, -1, -1, repeats, -1).flatten(2, 3)
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[dtype, repeats] = mask.masked_fill_(~visible, float("-inf"))
        return self._masks[dtype, repeats]

    def to_grid(self, x: Tensor) -> Tensor:
        """``[T, ...]`` -> ``[B, Qmax, ...]`` (padding zero-filled)."""
        if self.grid_index is None:
            return x.view(self.num_rows, self.max_query, *x.shape[1:])
        grid = x.new_zeros(self.num_rows, self.max_query, *x.shape[1:])
        grid[self.grid_index] = x
        return grid

    def from_grid(self, grid: Tensor) -> Tensor:
        """``[B, Qmax, ...]`` -> ``[T, ...]``."""
        return grid.flatten(0, 1) if self.grid_index is None else grid[self.grid_index]

    def attend(self, q: Tensor, cache: Tensor, scale: float) -> Tensor:
        """Attention of ``q: [T, nh, d]`` over each row's keys in ``cache: [slots, max_len, 2, nkv, d]``.

        Returns ``[T, nh, d]``. Query heads are grouped over key/value heads (GQA).
        """
        kv = self.addressing.gather(cache)  # [B, num_keys, 2, nkv, d]
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, nkv, num_keys, d]
        out = F.scaled_dot_product_attention(
            self.to_grid(q).transpose(1, 2), k, v, attn_mask=self.attention_mask(q.dtype), scale=scale, enable_gqa=True
        )  # [B, nh, Qmax, d]
        return self.from_grid(out.transpose(1, 2))
