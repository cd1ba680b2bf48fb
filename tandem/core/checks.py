"""Input checks for the sampling entry points: say which argument is wrong and how."""

from __future__ import annotations

from typing import Literal

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


# The whitespace a JSON grammar allows between tokens, as requests (`SamplingParams.json_whitespace`)
# and grammar specs (`GrammarSpec.whitespace`) give it: "default" = exactly `json.dumps`'s default
# separators (", " between items, ": " after keys, nothing elsewhere); "compact" = none (the
# separators "," and ":"); an int n = at most n whitespace characters (space, tab, newline,
# carriage return) in each gap between tokens (0 is "compact").
JsonWhitespace = Literal["default", "compact"] | int
MAX_JSON_WHITESPACE = 64  # the largest bound an int JsonWhitespace may give
JSON_WHITESPACE_RULE = (
    f"'default' (json.dumps separators), 'compact' (no whitespace) or an int in 0..{MAX_JSON_WHITESPACE}"
)


def is_json_whitespace(value: object) -> bool:
    """Whether `value` is a JsonWhitespace (a bool is not an int here)."""
    if isinstance(value, str):
        return value in ("default", "compact")
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_JSON_WHITESPACE
