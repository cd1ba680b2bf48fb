"""The SwiGLU MLP of Llama's layers, DeepSeek's dense layers and shared experts, and the EAGLE-3 draft."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from tandem.models.layers import Layer
from tandem.models.linear import MergedLinear, RowParallelLinear
from tandem.models.parallel import SINGLE, Shard


class GatedMLP(Layer):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` with ``gate_proj``/``up_proj`` merged: ``x: [T, H] -> [T, H]``.

    Tensor-parallel with a parallel ``shard``: gate/up column-parallel (each rank ``intermediate_size / size``
    columns), down row-parallel (one all-reduce; ``reduce=False``: none, the output is this rank's partial sum)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        shard: Shard = SINGLE,
        reduce: bool = True,
        **factory,
    ):
        super().__init__()
        parts = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, parts, bias=bias, shard=shard, **factory)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, shard=shard, reduce=reduce, **factory
        )

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
