"""Attention over a ragged batch and a paged KV cache: where each token's entry lives, and what each query sees.

:class:`RaggedLayout` is built once per forward from the batch's host-side spans and the cache's
block table, and shared by every layer of every provider (the Llama and DeepSeek targets, the
EAGLE, EAGLE-3 and MTP drafts). The engine plans its device arrays ahead (:meth:`RaggedLayout.stage`),
so they travel in the step phase's one staged copy (``tandem.core.transfer.Staging``), not in a copy
of each forward's own. It keeps two concerns apart:

- **Addressing** (:class:`BlockAddressing`, ``layout.addressing``): where a token's cache entry is
  written (:meth:`~BlockAddressing.write`: entry ``p % block_size`` of block ``table[slot][p // block_size]``
  of a pool ``[num_blocks, block_size, ...]``) and how a row's keys are read through its block table
  (:meth:`~BlockAddressing.gather`: ``[B, num_keys, ...]``, key ``j`` at position ``key_start + j``).
  This is the one seam the cache's layout goes through; graph mode (:meth:`RaggedLayout.static`)
  scatters every write and gathers one window of blocks for every row; the providers keep calling
  ``write`` and ``gather``.
- **Visibility**: queries sit in a padded ``[B, Qmax]`` grid (:meth:`RaggedLayout.to_grid`) and
  see the gathered keys whose position is at most theirs (:attr:`RaggedLayout.visible`, none for
  one token per row at each row's end); one ``scaled_dot_product_attention`` call runs with that
  mask. The mask is built over the addressing's key window, so a mode whose gather returns whole
  blocks past a row's end gets a mask over them (masking by position instead of slicing) and a
  fixed ``[B_bucket, Qmax]`` grid, without changes to the providers.

The common cases copy nothing: when every row has the same number of tokens (decode and verify
steps) the grid is a view of the tokens; when the rows' blocks in the key window are consecutive
(one row whose blocks were allocated in order; a contiguous cache, one block per slot, with
consecutive slots) their keys are a view of the pool, and tokens whose entries are consecutive
(one row's) are written as a slice. Keys start at ``key_start`` (a draft's cache holds nothing at
position 0), so a step of one token per row at each row's end needs no mask.

With :data:`ATTENTION_ENV` at ``auto`` (the default) the gather is skipped on CUDA: :meth:`RaggedLayout.attend`
runs the Triton paged-attention kernel (:mod:`tandem.kernels.paged_attention`), which reads each row's keys through
its block table and masks them by the queries' positions (:attr:`RaggedLayout.positions`), in both layouts (graph
mode's too: the kernel reads only device tensors, so it is captured with the step). On the CPU, steps of at most
:data:`FOLD_MAX_QUERY` queries per row (decode, verify, drafting) run the C kernel of the same contract
(:mod:`tandem.kernels.cpu_attention`, AVX-512 or AVX2) where it is built, outside ``torch.compile``
(:meth:`RaggedLayout.reads_pools`). The torch path stays the reference both kernels are tested against, and the
path of everything else (prefills, compiled CPU steps, CPUs without the kernel).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from tandem.core.transfer import Staging
from tandem.kernels import cpu_attention
from tandem.models.base import ForwardBatch, KVCache, RowSpans

# cuDNN's attention builds an execution plan for every new shape, tens of milliseconds of host time each, and an
# eager decode step's key length is new at every step; the other backends cost nothing per shape.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# A CUDA graph's shapes are fixed, so cuDNN plans each once, in the warm-up before capture, and inside a graph its
# kernel is the faster one (README, graph mode): graph mode builds its graphs under `graph_attention()`. First when
# it takes the shapes, else the others in order.
GRAPH_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *CUDA_SDPA_BACKENDS]
_cuda_sdpa_backends = CUDA_SDPA_BACKENDS  # GRAPH_SDPA_BACKENDS inside graph_attention()

# Which attention a layout runs, read once at import: "auto" (default), the Triton paged-attention kernel for CUDA
# tensors where Triton imports, the C kernel for the CPU's small steps (RaggedLayout.reads_pools), else gather +
# sdpa; "torch", gather + sdpa everywhere; "triton", the Triton kernel on every device (on the CPU only under
# TRITON_INTERPRET: the tests). A process-wide switch rather than an
# EngineConfig field: layouts are built by the providers, below the engine, and both paths compute the same thing.
ATTENTION_ENV = "TANDEM_ATTENTION"
ATTENTION_BACKENDS = ("auto", "torch", "triton")
attention_backend = os.environ.get(ATTENTION_ENV, "auto")

# The most queries per row that the CPU's torch attention folds into the query axis (RaggedLayout.attend): a verify
# step's. The fold's mask is g times sdpa's, which a prefill's queries x keys should not grow by; a decode step (one
# query per row) keeps sdpa's GQA, which is faster there.
FOLD_MAX_QUERY = 16


TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None  # a constant: compiled bodies read it


def uses_kernel(x: Tensor) -> bool:
    """Whether attention over ``x``'s device runs the paged-attention kernel (:data:`attention_backend`'s rule)."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"${ATTENTION_ENV} must be one of {', '.join(ATTENTION_BACKENDS)}; got {attention_backend!r}")
    if attention_backend == "auto":
        return x.device.type == "cuda" and TRITON_AVAILABLE
    return attention_backend == "triton"


@contextlib.contextmanager
def graph_attention():
    """While a CUDA graph is warmed up and captured: CUDA attention tries :data:`GRAPH_SDPA_BACKENDS` in order."""
    global _cuda_sdpa_backends
    outer, _cuda_sdpa_backends = _cuda_sdpa_backends, GRAPH_SDPA_BACKENDS
    try:
        yield
    finally:
        _cuda_sdpa_backends = outer


def sdpa(
    query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, *, scale: float, enable_gqa: bool = False
) -> Tensor:
    """``F.scaled_dot_product_attention`` (``attn_mask=mask``), on CUDA among :data:`CUDA_SDPA_BACKENDS` only, or
    :data:`GRAPH_SDPA_BACKENDS` in that order while a graph is built (:func:`graph_attention`)."""
    if query.device.type != "cuda":
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    with sdpa_kernel(_cuda_sdpa_backends, set_priority=True):
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


@dataclass
class BlockAddressing:
    """Where a paged cache holds the batch's entries, for pools ``[num_blocks, block_size, ...]``: row ``b``'s
    position ``p`` is entry ``p % block_size`` of block ``tables[b, p // block_size - first_table_block]``.
    Keys are read for positions ``key_start .. key_end - 1``."""

    write_at: tuple[Tensor, Tensor] | None  # ([T], [T]) int64: each token's block and its entry in that block
    write_start: int | None  # the first of T consecutive entries of the pool flattened (a slice write), else None
    tables: Tensor | None  # [B, nb] int64: each row's blocks over the key window (None: first_block's view)
    first_block: int | None  # the window's blocks are first_block .. first_block + B * nb - 1 in row order
    num_rows: int
    block_size: int
    key_offset: int  # position of the window's first block's first entry, subtracted from key_start
    key_start: int  # position of the first key
    key_end: int  # one past the position of the last key

    @property
    def num_keys(self) -> int:
        return self.key_end - self.key_start

    def write(self, cache: Tensor, entries: Tensor) -> None:
        """Store ``entries [T, ...]`` at each token's block and offset of ``cache [num_blocks, block_size, ...]``;
        a slice copy when they are consecutive (one row's), cheaper than the scatter, and it runs in every layer.

        The scatter indexes the pool by (block, entry), not a flattened view of it: a compiled graph that writes one
        pool more than once (a chained draft's steps) then updates it in place, where the view made inductor copy
        the whole pool and copy it back at every call."""
        if self.write_at is None:
            cache.flatten(0, 1)[self.write_start : self.write_start + entries.shape[0]] = entries
        else:
            cache.index_put_(self.write_at, entries.to(cache.dtype))

    def gather(self, cache: Tensor) -> Tensor:
        """The rows' keys: ``cache [num_blocks, block_size, ...]`` -> ``[B, num_keys, ...]``, a view of the pool
        when the window's blocks are consecutive, else one gather of the rows' blocks."""
        start, end = self.key_start - self.key_offset, self.key_end - self.key_offset
        if self.tables is None:
            rows, window = self.num_rows, -(-end // self.block_size)
            blocks = cache[self.first_block : self.first_block + rows * window]
            return blocks.view(rows, window * self.block_size, *cache.shape[2:])[:, start:end]
        # One index_select of the blocks: a copy at memory speed, where indexing by the [B, nb] table is several
        # times slower on the CPU.
        blocks = cache.index_select(0, self.tables.flatten())  # [B * nb, block_size, ...]
        return blocks.view(self.tables.shape[0], -1, *cache.shape[2:])[:, start:end]


def _plan_key(spans: RowSpans, cache: KVCache) -> tuple:
    """What a layout's addressing depends on besides its cache: the rows and the block table's rows."""
    return tuple(spans.starts), tuple(spans.lengths), tuple(spans.slots), cache.table.version


def _addressing(spans: RowSpans, cache: KVCache, staging: Staging) -> BlockAddressing:
    """Where the rows ``spans`` write and read in ``cache``, from the block table's host rows: the writes' blocks
    and entries, and the key window's tables ``[B, nb]`` (a row's blocks, then the scratch block's), staged in
    ``staging`` unless the writes are a slice and the window's blocks a view of the pool."""
    table, key_start, size = cache.table, cache.first_position, cache.table.block_size
    ends = spans.ends()
    max_key = max(ends)
    flat = [table.flat_index(slot, p) for slot, s, e in zip(spans.slots, spans.starts, ends) for p in range(s, e)]
    consecutive = flat == list(range(flat[0], flat[0] + len(flat)))
    first, window = key_start // size, -(-max_key // size) - key_start // size  # the key window's blocks
    rows = [table.rows[slot][first : first + window] for slot in spans.slots]
    ids = [b for row in rows for b in row]
    in_order = len(ids) == len(rows) * window and ids == list(range(ids[0], ids[0] + len(ids)))
    write_at = tables = None
    if not consecutive:  # each token's block, then its entry in the block: one [2, T] copy
        write_at = staging.int64([f // size for f in flat] + [f % size for f in flat]).view(2, -1).unbind()
    if not in_order:
        padded = [b for row in rows for b in (*row, *[table.scratch_block] * (window - len(row)))]
        tables = staging.int64(padded).view(len(rows), window)
    return BlockAddressing(
        write_at=write_at,
        write_start=flat[0] if consecutive else None,
        tables=tables,
        first_block=ids[0] if in_order else None,
        num_rows=len(rows),
        block_size=size,
        key_offset=first * size,
        key_start=key_start,
        key_end=max_key,
    )


@dataclass
class RaggedLayout:
    """Where each token of a ragged batch sits in a padded ``[B, Qmax]`` query grid, what it sees, and
    where its cache entry lives (:attr:`addressing`). Built once per forward by :meth:`build`."""

    addressing: BlockAddressing
    num_rows: int
    grid_index: tuple[Tensor, Tensor] | None  # (row, column) [T] of each token in the grid; None: T == B * Qmax
    masked: bool  # whether some query sees fewer than all keys (else no mask: visible is None)
    max_query: int
    max_key: int  # one past the last position of the batch
    positions: Tensor  # [B, Qmax] int64: each query's position (a padding query's: one its row's keys cover)
    _masks: dict[tuple, Tensor] = field(default_factory=dict, repr=False)  # attention_mask's, per (dtype, repeats)
    _tables: Tensor | None = field(default=None, repr=False)  # block_tables' arange, for an in-order window

    @classmethod
    def build(cls, batch: ForwardBatch, cache: KVCache) -> RaggedLayout:
        """The layout of ``batch`` over ``cache``'s block table (keys from its ``first_position``): its addressing as
        :meth:`stage` planned it, else planned now and sent in one copy (when its writes scatter or its tables are
        not a view of the pool)."""
        spans = batch.spans
        addressing = cache.planned.pop(_plan_key(spans, cache), None)
        if addressing is None:
            staging = Staging(batch.positions.device)
            addressing = _addressing(spans, cache, staging)
            staging.send()
        num_rows, num_tokens = batch.num_rows, batch.num_tokens
        ends = spans.ends()
        max_query, max_key = max(spans.lengths), max(ends)
        if num_tokens == num_rows * max_query:
            grid_index = None
            query_positions = batch.positions.view(num_rows, max_query)
        else:
            token_rows = batch.token_rows()
            grid_index = token_rows, torch.arange(num_tokens, device=token_rows.device) - batch.row_offsets[token_rows]
            # Padding queries see every key: their outputs are dropped, and no softmax row is empty.
            query_positions = batch.positions.new_full((num_rows, max_query), max_key - 1)
            query_positions[grid_index] = batch.positions
        masked = max_query > 1 or min(ends) < addressing.key_end
        return cls(addressing, num_rows, grid_index, masked, max_query, max_key, query_positions)

    @staticmethod
    def stage(spans: RowSpans, cache: KVCache, staging: Staging, num_steps: int = 1) -> None:
        """Plan ahead the addressing of ``num_steps`` forwards over ``cache`` (replacing what was planned before): the
        first over ``spans``, each next one a token per row past the last (a chained draft's steps,
        ``ForwardBatch.following``). Their write indices and block tables travel in ``staging``'s copy, which must
        be sent before the first forward; :meth:`build` takes each by its rows, so an eager step copies as graph
        mode's does (``GraphRunner.stage_forward``), once per phase."""
        cache.planned.clear()
        table = cache.table
        for _ in range(num_steps):
            rows = zip(spans.starts, spans.lengths, spans.slots)
            if not all(0 <= slot < table.num_slots and 0 <= s < s + n <= table.capacity(slot) for s, n, slot in rows):
                return  # rows that do not fit: their forward's cache check raises, naming the row
            cache.planned[_plan_key(spans, cache)] = _addressing(spans, cache, staging)
            spans = spans.following()

    @classmethod
    def static(
        cls, positions: Tensor, write_index: Tensor, tables: Tensor, key_start: int, block_size: int
    ) -> RaggedLayout:
        """The layout of a fixed grid of ``B`` rows by ``Q`` tokens (graph mode), built from device tensors only.

        Args:
            positions: ``[B, Q]`` int64, each token's position; a padding token takes a position its row
                already holds (the row's last), so its query sees real keys and no softmax row is empty.
            write_index: ``[B * Q]`` int64, each token's entry in the pool flattened to ``[num_blocks *
                block_size]``: padding tokens write to the scratch block, which no real row reads.
            tables: ``[B, nb]`` int64, the blocks each row reads (a padding row: the scratch block's), from its
                first: every row reads keys ``key_start .. nb * block_size - 1``: a CUDA graph its whole table;
                a compiled CPU step the blocks its rows reach (``nb`` a dynamic size).
            key_start: the cache's first position; block_size: the pools' positions per block.

        Every write is a scatter and every row gathers the same window of blocks, masked by position (key
        position <= query position) instead of sliced by the rows' lengths: nothing depends on a value
        read from the batch, so the layout's ops compile into one graph per ``(B, Q)``.
        """
        num_rows, max_query = positions.shape
        key_end = tables.shape[1] * block_size
        write_at = write_index.div(block_size, rounding_mode="floor"), write_index.remainder(block_size)
        addressing = BlockAddressing(
            write_at, None, tables, None, num_rows, block_size, key_offset=0, key_start=key_start, key_end=key_end
        )
        return cls(addressing, num_rows, None, True, max_query, key_end, positions)

    @property
    def visible(self) -> Tensor | None:
        """``[B, 1, Qmax, num_keys]`` bool: key position <= query position; None when every query sees every key.
        Built on demand: the paged-attention kernel masks by the positions themselves."""
        if not self.masked:
            return None
        keys = torch.arange(self.addressing.key_start, self.addressing.key_end, device=self.positions.device)
        return (keys <= self.positions[..., None])[:, None]

    def attention_mask(self, dtype: torch.dtype, repeats: int = 1) -> Tensor | None:
        """``visible`` as ``scaled_dot_product_attention``'s additive mask (0 or -inf) in ``dtype``,
        ``[B, 1, Qmax * repeats, num_keys]`` with each query's row repeated ``repeats`` times (MLA
        folds its heads into the query axis); None when every query sees every key.

        Built by the first layer that asks and kept for the others: sdpa would convert a bool mask,
        and MLA expand it, in every layer.
        """
        if not self.masked:
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

    def reads_pools(self, q: Tensor) -> bool:
        """Whether attention over ``q`` runs a paged-attention kernel (:meth:`attend_paged`), which reads the pools
        through the block tables, rather than gathering the keys: the Triton kernel where :func:`uses_kernel` says
        so; with :data:`ATTENTION_ENV` at ``auto``, the CPU's C kernel (:mod:`tandem.kernels.cpu_attention`) for a
        step of at most :data:`FOLD_MAX_QUERY` queries per row (a prefill keeps sdpa, which spreads over threads)."""
        if uses_kernel(q):
            return True
        return attention_backend == "auto" and self.max_query <= FOLD_MAX_QUERY and cpu_attention.applies(q)

    def attend(self, q: Tensor, cache: Tensor, scale: float) -> Tensor:
        """Attention of ``q: [T, nh, d]`` over each row's keys in ``cache: [num_blocks, block_size, 2, nkv, d]``.

        Returns ``[T, nh, d]``. Query heads are grouped over key/value heads (GQA). A paged-attention kernel
        where :meth:`reads_pools` says so (:meth:`attend_paged`), else gather + sdpa; on the CPU, for a step of
        2 to :data:`FOLD_MAX_QUERY` queries per row, sdpa over each group's queries folded into the query axis
        (``[B, nkv, Qmax * g, d]``, as MLA folds its heads) instead of sdpa's GQA.
        """
        if self.reads_pools(q):
            return self.attend_paged(q, cache[:, :, 0], cache[:, :, 1], scale)
        kv = self.addressing.gather(cache)  # [B, num_keys, 2, nkv, d]
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, nkv, num_keys, d]
        grid = self.to_grid(q)  # [B, Qmax, nh, d]
        num_rows, max_query, num_heads, head_dim = grid.shape
        groups = num_heads // k.shape[1]
        if q.device.type != "cpu" or groups == 1 or not 1 < max_query <= FOLD_MAX_QUERY:
            out = sdpa(grid.transpose(1, 2), k, v, self.attention_mask(q.dtype), scale=scale, enable_gqa=True)
            return self.from_grid(out.transpose(1, 2))  # from [B, nh, Qmax, d]
        # The CPU kernel then reads each K/V head once for all its group's queries, not once per query head.
        folded = grid.view(num_rows, max_query, -1, groups, head_dim).transpose(1, 2).flatten(2, 3)
        out = sdpa(folded, k, v, self.attention_mask(q.dtype, groups), scale=scale)  # [B, nkv, Qmax * g, d]
        out = out.view(num_rows, -1, max_query, groups, head_dim).transpose(1, 2)  # [B, Qmax, nkv, g, d]
        return self.from_grid(out.reshape(num_rows, max_query, num_heads, head_dim))

    def attend_paged(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, scale: float) -> Tensor:
        """A paged-attention kernel's attention of ``q: [T, nh, Dk]`` over each row's keys in ``key_cache:
        [num_blocks, block_size, nkv, Dk]`` and values in ``value_cache: [num_blocks, block_size, nkv, Dv]``
        (views of one pool: Llama's ``cache[:, :, 0]`` and ``cache[:, :, 1]``, MLA's latents ``cache[:, :, None]``
        and ``cache[:, :, None, :Dv]``), read through the block table: the Triton kernel where :func:`uses_kernel`
        says so, else the CPU's C kernel (:meth:`reads_pools`). Returns ``[T, nh, Dv]``."""
        if uses_kernel(q):
            from tandem.kernels import paged_attention_triton as kernel  # imports Triton: only where it runs
        else:
            kernel = cpu_attention.paged_attention
        a = self.addressing
        out = kernel(
            self.to_grid(q),
            key_cache,
            value_cache,
            self.block_tables(),
            self.positions,
            scale=scale,
            key_start=a.key_start,
            key_end=a.key_end,
            key_offset=a.key_offset,
        )
        return self.from_grid(out)

    def block_tables(self) -> Tensor:
        """``[B, nb]`` int64: each row's blocks over the key window, the first holding position ``key_offset``
        (a window of consecutive blocks, which :meth:`BlockAddressing.gather` views, as their ids)."""
        a = self.addressing
        if a.tables is not None:
            return a.tables
        if self._tables is None:
            window = -(-(a.key_end - a.key_offset) // a.block_size)
            ids = torch.arange(a.first_block, a.first_block + a.num_rows * window, device=self.positions.device)
            self._tables = ids.view(a.num_rows, window)
        return self._tables
