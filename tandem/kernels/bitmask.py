"""Grammar bitmask unpack + apply as a Triton kernel (layout: tandem/core/bitmask.py).

`allowed_tokens` is the unpack step, shared with the acceptance kernels for their draft tokens
(their passes over V unpack a word per tile row instead, and never write masked logits back).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.core.bitmask import bitmask_width
from tandem.core.checks import FLOAT_DTYPES, check_tensor

MAX_BLOCK = 4096  # tokens per program


@triton.jit
def allowed_tokens(mask_row, ids, in_vocab):
    """Block of bools: token `ids` allowed by the int32 bitmask row at `mask_row` (bit i%32 of word i//32)."""
    words = tl.load(mask_row + ids // 32, mask=in_vocab, other=0)
    return ((words >> (ids % 32)) & 1) != 0


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, vocab_size, logits_stride, mask_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < vocab_size
    allowed = allowed_tokens(mask_ptr + row * mask_stride, ids, in_vocab)
    # Store-only: allowed logits are never read or rewritten.
    tl.store(logits_ptr + row * logits_stride + ids, float("-inf"), mask=in_vocab & ~allowed)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every token the bitmask forbids to -inf, in place (xgrammar's `apply_token_bitmask_inplace`).

    logits:  [..., V] float32/bfloat16/float16, last dim contiguous; MODIFIED in place
    bitmask: [..., ceil(V/32)] int32 with the same leading dims (1 = allowed)
    """
    check_tensor("logits", logits, (None,) * logits.dim(), FLOAT_DTYPES)
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension, got a 0-d tensor")
    vocab_size = logits.shape[-1]
    check_tensor("bitmask", bitmask, (*logits.shape[:-1], bitmask_width(vocab_size)), (torch.int32,), logits.device)
    try:
        rows = logits.view(-1, vocab_size)
    except RuntimeError as error:
        raise ValueError(
            f"logits of shape {list(logits.shape)} and strides {logits.stride()} cannot be "
            "viewed as [N, V] rows; pass a contiguous tensor"
        ) from error
    if rows.shape[0] and rows.stride(-1) != 1:
        raise ValueError(f"logits must be contiguous in the vocabulary dimension, got stride {rows.stride(-1)}")
    words = bitmask.reshape(-1, bitmask.shape[-1])
    if words.stride(-1) != 1:
        words = words.contiguous()
    block = min(MAX_BLOCK, triton.next_power_of_2(max(vocab_size, 1)))
    grid = (rows.shape[0], triton.cdiv(vocab_size, block))
    if rows.shape[0] and vocab_size:
        _apply_bitmask_kernel[grid](rows, words, vocab_size, rows.stride(0), words.stride(0), BLOCK=block)
