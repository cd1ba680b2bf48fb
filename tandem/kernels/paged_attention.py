"""Paged attention as Triton kernels: each row's keys and values read straight through its block table.

The torch path (``tandem.models.attention.RaggedLayout.attend``) gathers a row's blocks into a contiguous
``[B, num_keys, ...]`` copy and runs ``scaled_dot_product_attention`` over it; this computes the same
attention without the copy. The contract, for row ``b``, query ``i`` and query head ``h``:

    out[b, i, h] = softmax_j(scale * q[b, i, h] . K_j) @ V_j   over key positions j with
                   key_start <= j < key_end and j <= positions[b, i]

where position ``j``'s entry is entry ``(j - key_offset) % block_size`` of block
``tables[b, (j - key_offset) // block_size]``, and query head ``h`` reads key/value head
``h // (nh // nkv)`` (GQA). Positions are device tensors and nothing is read back to the host, so a call can be
captured in a CUDA graph.

MLA (DeepSeek-V3's absorbed attention) caches one latent head per position, ``Dk = Dv + rope`` entries (512 +
64) whose first ``Dv`` are also the values: every query head reads that one head, and ``value_cache`` is a view
of ``key_cache``'s first ``Dv`` entries (:func:`values_in_keys`). The kernel then reads each key tile once: its
``Dv``-wide part is the value tile too, and ``q . k`` is the sum of two products, ``q[:Dv] . k[:Dv]`` over that
tile and ``q[Dv:] . k[Dv:]`` over the rotary entries, so no key is padded to a power of two (576 to 1024).

Flash-decoding: a program takes one row, one key/value head, a tile of the (query, head-in-group) pairs
sharing that head (a decode step's GQA group or MLA's every query head, a verify step's ``k + 1`` queries times
those: one key tile loaded serves them all) and one of ``num_splits`` slices of the keys its queries see. The
slices are cut from the row's own length, read on the device (one past the tile's last query position),
so a row much shorter than the key window (a CUDA graph's window is the whole table) still spreads
over every split, and a split past the row's keys does nothing. Each program runs an online softmax over
its slice and writes a partial output with its log-sum-exp; `_combine_kernel` weighs the splits'
partials by their share of the row's softmax mass. One split writes the output directly.

Arithmetic: scores, softmax and the accumulator in float32; ``q . k`` in the inputs' dtype with
float32 accumulation (IEEE float32 products for float32 inputs, not TF32); the probabilities are
rounded to the values' dtype before ``p @ v``, as flash attention does. Under Triton's interpreter (CPU
tensors) 16-bit operands are multiplied as float32 after that rounding: its 16-bit ``tl.dot`` is wrong.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = tl.constexpr(1.4426950408889634)
MIN_SPLIT_KEYS = 256  # keys per split at least: fewer, and combining the partials costs more than it spreads


# What a step changes (eager mode's key window and query count, and the strides that follow them: per program, not
# per element) is not specialised on, so steps do not recompile. The block size is a constant (one per cache):
# positions split into block and entry by shifts, not divisions.
_PER_STEP = ["key_start", "key_end", "key_offset", "num_splits", "num_queries", "m_blocks", "stride_tb", "stride_pb"]


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    """``acc + a @ b`` accumulated in float32 (``acc`` None: from zeros); with F32_DOT, IEEE float32 products."""
    if F32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit(do_not_specialize=_PER_STEP + ["stride_qb", "stride_ob", "stride_os", "stride_lb", "stride_ls"])
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_ke, stride_kh,
    stride_vb, stride_ve, stride_vh,
    stride_tb, stride_pb,
    stride_ob, stride_os, stride_oq, stride_oh,
    stride_lb, stride_ls, stride_lq,
    scale, key_start, key_end, key_offset, num_splits, num_queries, m_blocks,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    LATENT: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """One (row, key/value head and pair tile, split): its slice's online softmax, normalised, and its
    log2-sum-exp (``-inf`` for an empty slice); with one split, the output itself."""
    b = tl.program_id(0).to(tl.int64)
    head_kv = tl.program_id(1) // m_blocks
    split = tl.program_id(2)
    # Pair m is query m // GROUP of head head_kv * GROUP + m % GROUP.
    m = (tl.program_id(1) % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < num_queries * GROUP
    qi, head = m // GROUP, head_kv * GROUP + m % GROUP
    qpos = tl.load(pos_ptr + b * stride_pb + qi, mask=m_ok, other=-1).to(tl.int32)  # 32-bit key arithmetic
    # The keys any of the tile's queries sees: key_start .. end - 1 (a prefill's early tiles stop early).
    end = tl.minimum(tl.max(qpos, 0) + 1, key_end)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(end - key_start, 0), num_splits), BLOCK_N) * BLOCK_N
    lo = key_start + split * chunk
    hi = tl.minimum(lo + chunk, end)

    # The key entries read as keys alone, k0 .. DK - 1: all of them, or with LATENT those past the values.
    k0 = DV if LATENT else 0
    dk, dv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q_at = q_ptr + b * stride_qb + qi[:, None] * stride_qq + head[:, None] * stride_qh
    q = tl.load(q_at + k0 + dk[None, :], mask=m_ok[:, None] & (dk[None, :] < DK - k0), other=0.0)  # [BLOCK_M, BLOCK_DK]
    if LATENT:
        q_v = tl.load(q_at + dv[None, :], mask=m_ok[:, None] & (dv[None, :] < DV), other=0.0)  # [BLOCK_M, BLOCK_DV]
    qk_scale = scale * _LOG2E  # exp2 instead of exp
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        rel = kpos - key_offset
        block = tl.load(table_ptr + b * stride_tb + rel // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        entry = block * stride_kb + (rel % BLOCK_SIZE) * stride_ke + head_kv * stride_kh
        k = tl.load(
            k_ptr + entry[None, :] + k0 + dk[:, None], mask=k_ok[None, :] & (dk[:, None] < DK - k0), other=0.0
        )  # [BLOCK_DK, BLOCK_N]
        entry = block * stride_vb + (rel % BLOCK_SIZE) * stride_ve + head_kv * stride_vh
        v = tl.load(v_ptr + entry[:, None] + dv[None, :], mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
        s = _dot(q, k, None, F32_DOT)
        if LATENT:  # the value tile is the keys' first DV entries too: each latent is read once, for both products
            s = _dot(q_v, tl.trans(v), s, F32_DOT)
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= qpos[:, None]), s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a pair that has seen no key yet: all terms 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, None, F32_DOT)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    where = b * stride_ob + split * stride_os + qi[:, None] * stride_oq + head[:, None] * stride_oh + dv[None, :]
    tl.store(out_ptr + where, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (dv[None, :] < DV))
    if SPLIT:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + split * stride_ls + qi * stride_lq + head, lse, mask=m_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ps", "stride_lb", "stride_ls", "stride_ob"])
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ps, stride_pq, stride_ph,
    stride_lb, stride_ls, stride_lq,
    stride_ob, stride_oq, stride_oh,
    num_splits, NH: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One (row, query, head): the splits' partial outputs weighed by ``2 ** lse`` (a split's softmax mass)."""
    b = tl.program_id(0).to(tl.int64)
    qi, head = tl.program_id(1) // NH, tl.program_id(1) % NH
    s, dv = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_DV)
    lse = tl.load(
        lse_ptr + b * stride_lb + s * stride_ls + qi * stride_lq + head, mask=s < num_splits, other=-float("inf")
    )
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # every split empty (no key seen): out 0
    where = b * stride_pb + s[:, None] * stride_ps + qi * stride_pq + head * stride_ph + dv[None, :]
    part = tl.load(part_ptr + where, mask=(s[:, None] < num_splits) & (dv[None, :] < DV), other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    where = b * stride_ob + qi * stride_oq + head * stride_oh + dv
    tl.store(out_ptr + where, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


@functools.cache
def _programs_to_fill(device: torch.device) -> int:
    """Programs that keep ``device`` busy: two per multiprocessor (a few on the CPU's interpreter)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def tile_config(pairs: int, dim_k: int, dim_v: int, dtype: torch.dtype, latent: bool = False) -> dict[str, int]:
    """`_partial_kernel`'s tiles and warps for ``pairs`` (queries x heads in a group) per row and key/value head,
    ``latent`` where the values are the keys' first ``dim_v`` entries (:func:`values_in_keys`).

    Wide heads take fewer pairs and keys per tile, and bigger tiles (a prefill's, float32's) more warps, so that
    no thread's share of a tile spills out of its registers (compiled for sm_90: tests/kernels/test_paged_attention.py).
    MLA's latents take 64 pairs (32 in float32): every query head reads the one latent head, and each tile of pairs
    reads all of a row's latents again, which costs more than the few registers a 64-pair tile spills (README,
    paged attention)."""
    block_dv = max(16, triton.next_power_of_2(dim_v))
    if latent:  # BLOCK_DK: the rotary entries past the values
        return dict(
            BLOCK_M=min(max(16, triton.next_power_of_2(pairs)), 32 if dtype == torch.float32 else 64),
            BLOCK_N=16 if dtype == torch.float32 else 32,
            BLOCK_DK=max(16, triton.next_power_of_2(dim_k - dim_v)),
            BLOCK_DV=block_dv,
            num_warps=8,
        )
    block_dk = max(16, triton.next_power_of_2(dim_k))
    block_m = min(max(16, triton.next_power_of_2(pairs)), 64 if block_dk <= 128 else 16)
    num_warps = 4 if block_m * block_dk <= 32 * 128 and dtype != torch.float32 else 8
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=64 if block_dk <= 128 else 32,
        BLOCK_DK=block_dk,
        BLOCK_DV=block_dv,
        num_warps=num_warps,
    )


def values_in_keys(key_cache: Tensor, value_cache: Tensor) -> bool:
    """Whether ``value_cache`` is a view of ``key_cache``'s first entries (MLA's latents: ``cache[:, :, None]`` and
    ``cache[:, :, None, :Dv]``), so that one tile read serves as both."""
    return value_cache.data_ptr() == key_cache.data_ptr() and value_cache.stride() == key_cache.stride()


def choose_splits(num_rows: int, num_kv_heads: int, m_blocks: int, window: int, device: torch.device) -> int:
    """Splits of each row's keys: enough programs to fill ``device`` at batch 1, each split at least
    :data:`MIN_SPLIT_KEYS` of the ``window`` keys (a host-side choice: a CUDA graph fixes it with its shapes)."""
    programs = num_rows * num_kv_heads * m_blocks
    wanted = triton.cdiv(_programs_to_fill(device), programs)
    return max(1, min(wanted, triton.cdiv(window, MIN_SPLIT_KEYS), 64))


def paged_attention_triton(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    tables: Tensor,
    positions: Tensor,
    *,
    scale: float,
    key_start: int,
    key_end: int,
    key_offset: int = 0,
    splits: int | None = None,
) -> Tensor:
    """Attention of each row's queries over its keys and values in a paged cache, read through ``tables``.

    Args:
        query: ``[B, Q, nh, Dk]``, a decode step's ``Q = 1`` or a verify's ``k + 1``.
        key_cache: ``[num_blocks, block_size, nkv, Dk]`` (a view: Llama's ``cache[:, :, 0]``, MLA's latents
            ``cache[:, :, None]``); value_cache: ``[num_blocks, block_size, nkv, Dv]`` (``cache[:, :, 1]``,
            ``cache[:, :, None, :Dv]``: the keys' first entries, read once for both). ``nh`` is a multiple of
            ``nkv``; last dims contiguous.
        tables: ``[B, nb]`` integer, each row's blocks over the key window, ``tables[b, i]`` holding
            positions ``key_offset + i * block_size ..``.
        positions: ``[B, Q]`` int, each query's position: it sees the keys at positions ``<=`` its own
            (padding queries may take any position the row's table covers; their outputs are whatever it gives).
        scale: the scores' scale; key_start, key_end: the key window ``key_start .. key_end - 1`` (host ints).
        splits: slices of each row's keys (None: :func:`choose_splits`).

    Returns:
        ``[B, Q, nh, Dv]`` in the query's dtype.

    Traced by ``torch.compile``, it is the custom op ``torch.ops.tandem.paged_attention`` (its arguments are
    opaque to tracing: the kernel's choices read the caches' addresses and the device's properties).
    """
    if torch.compiler.is_compiling():
        return paged_attention_op(
            query, key_cache, value_cache, tables, positions,
            scale=scale, key_start=key_start, key_end=key_end, key_offset=key_offset, splits=splits,
        )  # fmt: skip
    rows, width, num_heads, dim_k = query.shape
    num_kv_heads, dim_v = value_cache.shape[2], value_cache.shape[3]
    if num_heads % num_kv_heads or key_cache.shape[2] != num_kv_heads or key_cache.shape[3] != dim_k:
        raise ValueError(
            f"query heads {num_heads} x {dim_k} do not group over key heads {tuple(key_cache.shape[2:])} "
            f"and value heads {tuple(value_cache.shape[2:])}"
        )
    if not key_cache.stride(-1) == value_cache.stride(-1) == 1:
        raise ValueError("key_cache and value_cache need a contiguous last dimension (views of the pool's entries)")
    query = query if query.stride(-1) == 1 else query.contiguous()
    group, latent = num_heads // num_kv_heads, values_in_keys(key_cache, value_cache)
    tiles = tile_config(width * group, dim_k, dim_v, query.dtype, latent)
    m_blocks = triton.cdiv(width * group, tiles["BLOCK_M"])
    if splits is None:
        splits = choose_splits(rows, num_kv_heads, m_blocks, key_end - key_start, query.device)
    out = query.new_empty(rows, width, num_heads, dim_v)
    if splits == 1:  # the partial is the output; no log-sum-exp is written (a placeholder pointer)
        part, lse = out.unsqueeze(1), out.new_empty(1, 1, 1, dtype=torch.float32)
    else:
        part = query.new_empty(rows, splits, width, num_heads, dim_v, dtype=torch.float32)
        lse = query.new_empty(rows, splits, width, num_heads, dtype=torch.float32)
    _partial_kernel[(rows, num_kv_heads * m_blocks, splits)](
        query, key_cache, value_cache, tables, positions, part, lse,
        query.stride(0), query.stride(1), query.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        tables.stride(0), positions.stride(0),
        part.stride(0), part.stride(1), part.stride(2), part.stride(3),
        *lse.stride()[:3],
        scale, key_start, key_end, key_offset, splits, width, m_blocks,
        BLOCK_SIZE=key_cache.shape[1], GROUP=group, DK=dim_k, DV=dim_v, LATENT=latent, SPLIT=splits > 1,
        # IEEE float32 products for float32 inputs; and on the CPU (the interpreter), whose 16-bit dot is wrong.
        F32_DOT=query.dtype == torch.float32 or query.device.type != "cuda",
        **tiles,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(rows, width * num_heads)](
            part, lse, out,
            *part.stride()[:4], *lse.stride()[:3], *out.stride()[:3], splits,
            NH=num_heads, DV=dim_v,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_DV=tiles["BLOCK_DV"],
            num_warps=4 if tiles["BLOCK_DV"] <= 128 else 8,
        )  # fmt: skip
    return out


# What a compiled graph calls; eager calls skip the dispatcher.
paged_attention_op = torch.library.custom_op("tandem::paged_attention", paged_attention_triton, mutates_args=())


@paged_attention_op.register_fake
def _(query, key_cache, value_cache, tables, positions, *, scale, key_start, key_end, key_offset=0, splits=None):
    return query.new_empty(*query.shape[:3], value_cache.shape[3])
