"""Async scheduling: a plain decode step launched before the previous one's tokens are read.

A synchronous step reads its sampled tokens back, commits them on the host (text, stop rules, grammars, finished
rows' slots), then plans and launches the next step, so the device idles while the host works. With
``EngineConfig.async_scheduling`` (vLLM's ``--async-scheduling``) the engine launches step N + 1's forward first, fed
with step N's tokens where they lie on the device, and only then reads and commits step N: the host's work runs
while the device computes step N + 1's forward. Step N + 1 samples after that commit, so a grammar row's mask and a
row's penalties are built from the state its token N left, as in a synchronous step.

Only plain decode steps: every running row decodes one token, without logprobs (read from the logits at the
commit, which the next forward overwrites in graph mode), and no draft (its proposal reads the committed tokens). A
row that finishes at step N has had step N + 1 run for it; that token is dropped. While a step is in flight its rows'
``tokens`` end with a placeholder for its token, so that every length the scheduler and the caches read is the one
after it (`Engine._overlapped_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.engine.request import Request


@dataclass
class InFlight:
    """A launched plain step whose tokens are not read yet.

    rows:   the step's rows, in its batch's order
    tokens: [B] int64 on the device, each row's sampled token (the next step's input ids)
    host:   [B] int64 on the host (pinned on CUDA), filled by a copy queued right after the sampling
    copied: the event after that copy (None off CUDA), so a read waits for this step and not for the next
    """

    rows: list[Request]
    tokens: Tensor
    host: Tensor
    copied: torch.cuda.Event | None

    @classmethod
    def launch(cls, rows: list[Request], tokens: Tensor) -> InFlight:
        """Queue the copy of ``tokens [B]`` to the host behind the work that samples them; returns at once."""
        if tokens.device.type != "cuda":
            return cls(rows, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(rows, tokens, host, copied)

    def read(self) -> list[int]:
        """The step's tokens, once its copy has landed (a wait for this step's work only)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()
