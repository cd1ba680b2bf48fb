"""The base of every building block: :class:`Layer`, an ``nn.Module`` whose call skips the hooks.

The blocks themselves live one concern per module: :mod:`~tandem.models.linear` (matmuls, merged
projections, weights stored narrower), :mod:`~tandem.models.norm` (RMSNorm),
:mod:`~tandem.models.rope` (rotary embeddings), :mod:`~tandem.models.mlp` (the SwiGLU MLP),
:mod:`~tandem.models.moe` (routed experts) and :mod:`~tandem.models.vocab` (the vocabulary-parallel embedding
and LM head).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Layer(nn.Module):
    """An ``nn.Module`` whose call goes straight to ``forward``; hooks registered on a Layer do not run.

    Invariant: the same result as ``nn.Module.__call__`` for a module without hooks. Reason: a
    decoder layer makes several module calls per step, and on a small model
    ``nn.Module.__call__``'s hook dispatch costs a visible share of the forward.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)
