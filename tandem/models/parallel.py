"""Where a process's part of a model sits in a parallel group, and the collectives its layers call.

A :class:`Shard` is handed to a provider's ``build`` (``load_target(..., shard=...)``): tensor parallel splits
attention heads, MLP columns and the vocabulary over ``size`` ranks; DeepSeek-V3's attention may instead run
data-parallel (each rank the rows of its slots, :meth:`Shard.owns_slot`) with its experts split across ranks
(expert parallel). ``Shard()`` (size 1) is the single-device model, for which every collective is the identity.

The collectives are torch's functional ones (``torch.distributed._functional_collectives``), so a forward that
calls them still compiles whole (graph mode); they run over the group's backend (NCCL on CUDA, gloo on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
import torch.distributed._functional_collectives as collectives
from torch import Tensor, nn


@dataclass(frozen=True)
class Shard:
    """This process's place: ``rank`` of ``size`` ranks in ``group`` (None: the default group)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    data_parallel_attention: bool = False  # DeepSeek-V3: attention over this rank's rows, replicated weights
    expert_parallel: bool = False  # DeepSeek-V3: whole routed experts per rank (else each expert split by columns)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def part(self, total: int, what: str) -> tuple[int, int]:
        """``(start, count)`` of this rank's equal part of ``total`` items (heads, columns, experts, ids); ``what``
        names them in the ValueError raised when ``size`` does not divide ``total``."""
        if total % self.size:
            raise ValueError(f"{what}: {total} does not divide over {self.size} ranks")
        count = total // self.size
        return self.rank * count, count

    def owns_slot(self, slot: int) -> bool:
        """Whether this rank runs the attention of the row in ``slot`` (data-parallel attention; always, else)."""
        return not self.data_parallel_attention or slot % self.size == self.rank

    def _group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's ``x`` (``x`` itself with one rank)."""
        if not self.parallel:
            return x
        return collectives.wait_tensor(collectives.all_reduce(x, "sum", self._group()))

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (``x`` itself with one rank)."""
        if not self.parallel:
            return x
        dim = dim % x.dim()
        stacked = x.movedim(dim, 0).contiguous()  # the functional all-gather concatenates along dim 0 only
        gathered = collectives.wait_tensor(collectives.all_gather_single(stacked, 0, self._group()))
        return gathered.movedim(0, dim)


SINGLE = Shard()  # the whole model on one device


def parameter_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s parameters as stored (a shared one counted once, a narrowed one at its width): what
    a rank holds of its shard's weights. Works on the ``"meta"`` device, so real shapes can be counted unloaded."""
    return sum(param.numel() * param.element_size() for param in module.parameters())
