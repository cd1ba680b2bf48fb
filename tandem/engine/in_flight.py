"""Async scheduling: a plain decode step launched before the previous one's tokens are read.

A synchronous step reads its sampled tokens back, commits them on the host (text, stop rules, grammars, finished
rows' slots), then plans and launches the next step, so the device idles while the host works. With
``EngineConfig.async_scheduling`` (vLLM's ``--async-scheduling``) the engine launches step N + 1's forward first, fed
with step N's tokens where they lie on the device, and only then reads and commits step N: the host's work runs
while the device computes step N + 1's forward. Step N + 1 samples after that commit, so a grammar row's mask and a
row's penalties are built from the state its token N left, as in a synchronous step.

Only plain decode steps: every running row decodes one token, and no draft (its proposal reads the committed tokens);
logprobs are computed on the device as the step samples (the next forward overwrites a graph's logits) and read
with its tokens. A row that finishes at step N has had step N + 1 run for it; that token is dropped. While a step is
in flight its rows' ``tokens`` end with a placeholder for its token, so that every length the scheduler and the
caches read is the one after it (`Engine._overlapped_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.decoding.logprobs import TokenLogprob, assemble
from tandem.engine.request import Request
from tandem.models.base import Draft


def resolve_async_scheduling(
    setting: bool | None, device: torch.device, graph_mode: str, *, draft: Draft | None, parallel: bool
) -> bool:
    """Whether an engine launches its plain decode steps ahead of their reads (``EngineConfig.async_scheduling``).

    None ("auto") turns it on where it was measured to pay: a plain engine on one CUDA device in graph mode (README,
    "Graph mode"), where the replay is short and the host's commit would otherwise leave the device idle. Eager CUDA
    steps are bound by the host either way, and a CPU step's forward runs on the host itself. True with a draft
    (whose proposal reads the committed tokens) or with parallel ranks raises ``ValueError``."""
    if setting is None:
        return device.type == "cuda" and graph_mode == "compiled" and draft is None and not parallel
    if setting and (draft is not None or parallel):
        raise ValueError(
            "async_scheduling overlaps plain decode steps of one device: it needs an engine without a draft "
            f"and without parallel ranks (draft: {type(draft).__name__}, ranks: {parallel})"
        )
    return setting


@dataclass
class InFlight:
    """A launched plain step whose tokens are not read yet.

    rows:     the step's rows, in its batch's order
    tokens:   [B] int64 on the device, each row's sampled token (the next step's input ids)
    host:     on the host (pinned on CUDA), filled by copies queued right after the sampling: the tokens [B], and
              where a row asks for logprobs `decoding.logprobs.logprob_tensors` of every row (the most any asks)
    copied:   the event after those copies (None off CUDA), so a read waits for this step and not for the next
    """

    rows: list[Request]
    tokens: Tensor
    host: list[Tensor]
    copied: torch.cuda.Event | None

    @classmethod
    def launch(cls, rows: list[Request], tokens: Tensor, logprobs: tuple[Tensor, ...] = ()) -> InFlight:
        """Queue the copies of ``tokens [B]`` (and ``logprobs``) to the host behind the work that computes them;
        returns at once."""
        if tokens.device.type != "cuda":
            return cls(rows, tokens, [tokens, *logprobs], None)
        host = []
        for tensor in (tokens, *logprobs):
            host.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
            host[-1].copy_(tensor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(rows, tokens, host, copied)

    def read(self) -> list[int]:
        """The step's tokens, once its copies have landed (a wait for this step's work only)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host[0].tolist()

    def token_logprobs(self, b: int, emitted: list[int], num_top: int) -> list[TokenLogprob]:
        """Row ``b``'s emitted token's (none or one) logprob and its ``num_top`` most likely; after :meth:`read`."""
        if not emitted:
            return []
        chosen, values, ids = (tensor[b] for tensor in self.host[1:])
        return assemble(emitted, [chosen.item()], [values[:num_top].tolist()], [ids[:num_top].tolist()])
