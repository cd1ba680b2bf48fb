"""Host data onto the device without making the host wait for the device.

The engine builds every batch, sampling table and mask on the host while the device still runs
the previous work; a copy that waited for that work would serialise the two (docs/DESIGN.md,
"Overlap"). Every host-to-device copy on the step path goes through :func:`to_device`.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device | str | None) -> Tensor:
    """``host`` (a CPU tensor) on ``device``, without making the host wait for the device.

    A copy from pageable memory (``tensor.to("cuda")``, ``torch.tensor(..., device="cuda")``)
    waits until every kernel already queued on the stream has run, which would stall the host at
    each batch it builds. Staged in pinned memory, the copy is queued ``non_blocking`` instead;
    the caching host allocator keeps the pinned copy alive until the stream has read it.
    """
    device = torch.device(device) if device is not None else host.device
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def int64_tensor(values: Sequence[int], device: torch.device | str | None = None) -> Tensor:
    """``[len(values)]`` int64 from Python ints, on ``device`` through :func:`to_device`.

    ``torch.tensor`` converts a list element by element, which adds up over a long sequence;
    through ``array('q')`` it is one copy."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    return to_device(torch.frombuffer(array.array("q", values), dtype=torch.int64), device)
