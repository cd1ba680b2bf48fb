"""Input checks for the sampling entry points: say which argument is wrong and how."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(
    name: str,
    value: object,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> torch.Tensor:
    """Raise ValueError unless `value` is a tensor of `shape` (None = any size) and a dtype in `dtypes`."""
    dims = ", ".join("*" if size is None else str(size) for size in shape)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a tensor [{dims}], got {type(value).__name__}")
    if value.dim() != len(shape) or any(want is not None and got != want for got, want in zip(value.shape, shape)):
        raise ValueError(f"{name} must have shape [{dims}], got {list(value.shape)}")
    if value.dtype not in dtypes:
        allowed = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"{name} must be {allowed}, got {str(value.dtype).removeprefix('torch.')}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}, expected {device} like the logits")
    return value
