"""FP8 block-quantized checkpoints in DeepSeek-V3's published layout, dequantized at load.

The layout: ``config.json`` declares ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``; each quantized linear's
``weight: [out, in] float8_e4m3fn`` comes with ``weight_scale_inv: [ceil(out/128), ceil(in/128)]
float32``, and block ``(i, j)`` of the weight stands for ``weight[i*128:(i+1)*128, j*128:(j+1)*128] *
weight_scale_inv[i, j]`` (blocks at the right and bottom edges are partial). Norms, embeddings, the
MoE gate (``mlp.gate.weight``, ``e_score_correction_bias``) and ``lm_head`` are stored unquantized.

:meth:`tandem.models.loading.WeightReader.take` dequantizes each such weight as it is read: the
product in float32 (DeepSeek's ``weight_dequant`` and ``fp8_cast_bf16.py`` compute the same), then
one rounding to the load dtype. Only the tensor being read is ever float32, so loading takes the
memory of the model in its load dtype plus one weight.

On a GPU too: no GPU was at hand to validate a block-scaled FP8 Triton matmul (the peers' way of
keeping the weights in FP8), and the dequantized weights are the values the checkpoint represents,
so the model computes the same function; what FP8 kept in memory would save bytes and matmul time,
not change a token.

A ``quantization_config`` tandem cannot read (another ``quant_method`` such as gptq, awq,
bitsandbytes, compressed-tensors, or fp8 with another format, block size or activation scheme) is
refused by :func:`block_size` before any weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SCALE_SUFFIX = "_scale_inv"  # "<linear>.weight" -> "<linear>.weight_scale_inv"
SUPPORTED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def block_size(quantization: dict[str, Any] | None, file: Path) -> tuple[int, int] | None:
    """The ``(rows, columns)`` of a weight block for ``quantization`` (a ``quantization_config``, read
    from ``file``), None for an unquantized checkpoint.

    Raises ValueError naming the method, the entry and ``file`` for anything but :data:`SUPPORTED`
    (a missing ``fmt`` reads as e4m3, as transformers' fine-grained FP8 configs leave it out).
    """
    if not quantization:
        return None
    method = quantization.get("quant_method", "<none>")
    if method != SUPPORTED["quant_method"]:
        raise ValueError(
            f"{file}: quantization_config quant_method {method!r} is not supported: tandem reads "
            f"unquantized checkpoints and fp8 ({SUPPORTED}); dequantize the checkpoint first"
        )
    found = {**quantization, "fmt": quantization.get("fmt", "e4m3")}
    for key in ("fmt", "activation_scheme", "weight_block_size"):
        if found.get(key) != SUPPORTED[key]:
            raise ValueError(
                f"{file}: fp8 quantization_config {key}={found.get(key)!r} is not supported "
                f"(expected {SUPPORTED[key]!r})"
            )
    rows, columns = SUPPORTED["weight_block_size"]
    return rows, columns


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """``weight: [out, in] float8_e4m3fn`` times ``scale_inv: [ceil(out/rows), ceil(in/columns)] float32``
    expanded over its ``block = (rows, columns)`` blocks -> ``[out, in]`` in ``dtype``, on weight's device.

    The product is taken in one float32 buffer padded to whole blocks (the scales then broadcast over a
    view, never expanded), cast once to ``dtype``.
    """
    (out, inp), (rows, columns) = weight.shape, block
    padded = torch.zeros(
        scale_inv.shape[0] * rows, scale_inv.shape[1] * columns, dtype=torch.float32, device=weight.device
    )
    padded[:out, :inp] = weight
    padded.view(scale_inv.shape[0], rows, scale_inv.shape[1], columns).mul_(scale_inv.float()[:, None, :, None])
    return padded[:out, :inp].to(dtype).contiguous()


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a weight of ``shape = (out, in)``: ``(ceil(out/rows), ceil(in/columns))``."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])
