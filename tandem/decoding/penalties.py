"""Logit bias and repetition, frequency and presence penalties, at every verify position.

A row whose `SamplingParams` ask for them has its logits adjusted before the target
distribution is formed (sampling.py: grammar mask, temperature, filters), in vLLM's order:

    logits += logit_bias                                     (OpenAI: token id -> value)
    seen    = the token occurs in the prompt or the output so far
    logits  = logits / r if seen and logits > 0,  logits * r if seen and logits <= 0
    logits -= frequency * count + presence * (count > 0)     (count: occurrences in the output)

With speculation, "the output so far" at verify position j is the committed output followed by
the drafts d_0 .. d_{j-1}: position j's distribution is only used when those drafts are
accepted, and then they are output. So one row's counts differ from position to position, and
speculative decoding with penalties stays exactly plain decoding with penalties. Drafts that
choose their tokens apply the same adjustments while they chain (`apply_after`), so what they
propose is what the penalised target would pick.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tandem.core.transfer import int64_tensor, to_device
from tandem.decoding.params import SamplingParams


@dataclass(frozen=True)
class LogitAdjustments:
    """One step's penalties and biases, one row per request (rows that ask for none are neutral).

    presence, frequency: [B] float32 (0 = off); repetition: [B] float32 (1 = off)
    output_counts:       [B, V] float32, occurrences of each token in the committed output
    prompt_seen:         [B, V] bool, tokens of the prompt (of rows with a repetition penalty), or None
                         when no row has one (the rule is then skipped: r = 1 changes nothing)
    bias:                [B, V] float32, or None when no row has a logit bias
    """

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_counts: torch.Tensor
    prompt_seen: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompts: list[list[int]],
        outputs: list[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> LogitAdjustments:
        """The adjustments of a batch (per row: its params, prompt and committed output ids, each < V)."""
        adjusted = [b for b, p in enumerate(params) if p.adjusts_logits]  # the other rows stay zero: never read

        def dense(tokens: dict[int, list[int]], values: dict[int, list[float]] | None = None) -> torch.Tensor:
            """[B, V] float32: for row b, the sum over ``tokens[b]`` of ``values[b]`` (None: ones) at each id.

            Summed on the device from the ids: the host sends the tokens, never a [B, V] table."""
            ids = list(itertools.chain.from_iterable(tokens.values()))
            lengths = int64_tensor([len(row) for row in tokens.values()], device)
            rows = int64_tensor(list(tokens), device).repeat_interleave(lengths, output_size=len(ids))
            weights = (
                torch.ones(len(ids), device=device)
                if values is None
                else to_device(
                    torch.tensor(list(itertools.chain.from_iterable(values.values())), dtype=torch.float32), device
                )
            )
            table = torch.zeros(len(params), vocab_size, device=device)
            return table.index_put_((rows, int64_tensor(ids, device)), weights, accumulate=True)

        def per_row(name: str) -> torch.Tensor:
            return to_device(torch.tensor([getattr(p, name) for p in params], dtype=torch.float32), device)

        biases = {b: params[b].logit_bias for b in adjusted if params[b].logit_bias}
        # Only the repetition penalty reads the prompt: with r = 1 being seen changes nothing.
        repeating = {b: prompts[b] for b in adjusted if params[b].repetition_penalty != 1}
        return cls(
            presence=per_row("presence_penalty"),
            frequency=per_row("frequency_penalty"),
            repetition=per_row("repetition_penalty"),
            output_counts=dense({b: outputs[b] for b in adjusted}),
            prompt_seen=dense(repeating) > 0 if repeating else None,
            bias=dense(
                {b: list(bias) for b, bias in biases.items()}, {b: list(bias.values()) for b, bias in biases.items()}
            )
            if biases
            else None,
        )

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Adjusted logits of every verify position (module docstring).

        logits: [B, k+1, V] float; drafts: [B, k] int64, -1 (or any id outside [0, V)) = no draft
        returns [B, k+1, V] float32; the values of a row without adjustments are unchanged.
        """
        batch, num_positions, vocab_size = logits.shape
        real = (drafts >= 0) & (drafts < vocab_size)
        drafted = torch.zeros(batch, num_positions, vocab_size, device=logits.device)
        # Draft j is output before position j + 1: one-hot it there, then sum along the window.
        drafted[:, 1:].scatter_(-1, drafts.clamp(0, vocab_size - 1).unsqueeze(-1), real.unsqueeze(-1).float())
        return self._adjust(logits.float(), self.output_counts.unsqueeze(1) + drafted.cumsum(dim=1))

    def apply_after(self, logits: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
        """Adjusted logits ``[B, V]`` of the position after ``proposed [B, i]`` (valid ids): what a
        draft chooses from while it proposes (a :class:`tandem.models.base.LogitAdjuster`)."""
        counts = self.output_counts.scatter_add(1, proposed, torch.ones_like(proposed, dtype=torch.float32))
        return self._adjust(logits.float().unsqueeze(1), counts.unsqueeze(1)).squeeze(1)

    def _adjust(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``logits, counts: [B, P, V]`` float32 (counts: each token's occurrences in the output before
        each position) -> adjusted ``[B, P, V]``."""
        batch = len(logits)
        if self.bias is not None:
            logits = logits + self.bias.unsqueeze(1)
        if self.prompt_seen is not None:
            seen = (counts > 0) | self.prompt_seen.unsqueeze(1)
            repetition = self.repetition.view(batch, 1, 1)
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        present = counts.clamp(max=1)  # counts are whole numbers: (counts > 0) in one op, already float
        return logits - self.frequency.view(batch, 1, 1) * counts - self.presence.view(batch, 1, 1) * present
