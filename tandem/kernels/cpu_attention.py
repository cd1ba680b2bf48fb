"""Paged attention of float32 queries on the CPU, in C (``cpu_attention.c``): the Triton kernel's contract.

:func:`paged_attention` takes what :func:`tandem.kernels.paged_attention_triton` takes (a ``[B, Q, nh, Dk]`` query
grid, key and value pools read through ``[B, nb]`` block tables, each query's position) and computes the same
attention: scores, softmax and the weighted sum of values in float32, each query over its own keys alone. A
decode, verify or draft step of a small model attends over a few hundred keys per row, where the torch path's
gather, transposes and ``scaled_dot_product_attention`` spend more in dispatch than in arithmetic; one C call
replaces them. Under ``torch.compile`` the layers keep the torch path
(:meth:`tandem.models.attention.RaggedLayout.reads_pools` chooses).

The C code has an AVX-512 and an AVX2 + FMA build of the same stages; :data:`ISA` is the one in use, the fastest this
CPU runs. Their sums run in 16 and 8 lanes, so they round differently (each in an order fixed by the sizes alone).
The extension is built at install when a C compiler is there (``pyproject.toml``); without it, or on a CPU
with neither, :func:`available` is False and attention gathers the keys and runs ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    from tandem.kernels import _cpu_attention
except ImportError:  # built without a C compiler
    _cpu_attention = None

BUILDS = ("avx512", "avx2")  # the C code's builds, fastest first, by the index its `paged_attention` takes
RUNNABLE: tuple[str, ...] = () if _cpu_attention is None else tuple(_cpu_attention.isas())  # those this CPU runs
ISA: str | None = RUNNABLE[0] if RUNNABLE else None  # the build `paged_attention` calls
_AVAILABLE = ISA is not None
_BUILD = -1 if ISA is None else BUILDS.index(ISA)


def available() -> bool:
    """True when the extension is built and this CPU runs one of its builds (x86-64 with AVX-512 F or AVX2, and
    FMA)."""
    return _AVAILABLE


def applies(q: Tensor) -> bool:
    """Whether :func:`paged_attention` takes queries like ``q``: CPU float32, outside ``torch.compile`` (the pools
    are the model's, in its dtype and on its device)."""
    return _AVAILABLE and q.dtype == torch.float32 and q.is_cpu and not torch.compiler.is_compiling()


def paged_attention(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    positions: Tensor,
    *,
    scale: float,
    key_start: int,
    key_end: int,
    key_offset: int,
) -> Tensor:
    """Attention of each query over its row's keys, read through its block table.

    Args:
        q: ``[B, Q, nh, Dk]`` float32, the last axis contiguous.
        key_cache: ``[num_blocks, block_size, nkv, Dk]``; value_cache: ``[num_blocks, block_size, nkv, Dv]``
            (views of one pool, any strides, the last axis contiguous). Query head ``h`` reads head
            ``h // (nh // nkv)``.
        block_tables: ``[B, nb]`` int64, row ``b``'s blocks, the first holding position ``key_offset``.
        positions: ``[B, Q]`` int64, each query's position: it sees keys ``key_start <= j < key_end``, ``j <=`` it.
        scale: the scores' factor; key_start, key_end, key_offset: the key window (as the Triton kernel's).
    Returns:
        ``[B, Q, nh, Dv]`` float32, contiguous; a query that sees no key gets zeros.
    """
    rows, queries, heads, key_dim = q.shape
    _, block_size, kv_heads, value_dim = value_cache.shape
    if not (  # what the C code's reads rely on, checked without building objects: it runs in every layer
        q.dtype == key_cache.dtype == value_cache.dtype == torch.float32
        and block_tables.dtype == positions.dtype == torch.int64
        and q.is_cpu
        and key_cache.is_cpu
        and value_cache.is_cpu
        and q.stride(3) == key_cache.stride(3) == value_cache.stride(3) == 1
        and key_cache.shape[3] == key_dim
        and key_cache.shape[1] == block_size
        and key_cache.shape[2] == kv_heads
        and block_tables.shape[0] == positions.shape[0] == rows
        and positions.shape[1] == queries
        and block_tables.stride(1) == positions.stride(1) == 1
        and -(-(key_end - key_offset) // block_size) <= block_tables.shape[1]
    ):
        raise ValueError(
            f"paged_attention: q {tuple(q.shape)}, pools {tuple(key_cache.shape)} / {tuple(value_cache.shape)}, "
            f"tables {tuple(block_tables.shape)}, positions {tuple(positions.shape)} and the window "
            f"{key_start}..{key_end} from {key_offset} do not fit (CPU float32 tensors, int64 tables and positions)"
        )
    out = q.new_empty(rows, queries, heads, value_dim)
    q_row, q_query, q_head, _ = q.stride()
    k_block, k_entry, k_head, _ = key_cache.stride()
    v_block, v_entry, v_head, _ = value_cache.stride()
    _cpu_attention.paged_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        positions.data_ptr(),
        out.data_ptr(),
        q_row,
        q_query,
        q_head,
        k_block,
        k_entry,
        k_head,
        v_block,
        v_entry,
        v_head,
        block_tables.stride(0),
        positions.stride(0),
        rows,
        queries,
        heads,
        kv_heads,
        key_dim,
        value_dim,
        block_size,
        key_start,
        key_end,
        key_offset,
        scale,
        _BUILD,
    )
    return out
