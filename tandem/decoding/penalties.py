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
from functools import cached_property

import torch

from tandem.core.transfer import Staging
from tandem.decoding.params import SamplingParams

PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # the [B] fields, in order


@dataclass(frozen=True)
class TokenTable:
    """A ``[B, V]`` float32 table sent as its entries: row ``rows[i]`` adds ``weights[i]`` (None: 1) at id
    ``ids[i]``; rows, ids: [N] int64, weights: [N] float32 or None. The host sends the entries, never the table."""

    shape: tuple[int, int]
    rows: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor | None

    @classmethod
    def stage(
        cls,
        shape: tuple[int, int],
        tokens: dict[int, list[int]],
        values: dict[int, list[float]] | None,
        staging: Staging,
    ) -> TokenTable:
        """Row ``b``'s entries are ``tokens[b]`` with ``values[b]`` (None: ones), staged on ``staging``."""
        rows = itertools.chain.from_iterable([b] * len(row) for b, row in tokens.items())
        weights = None if values is None else staging.float32(list(itertools.chain.from_iterable(values.values())))
        return cls(
            shape,
            staging.int64(list(rows)),
            staging.int64(list(itertools.chain.from_iterable(tokens.values()))),
            weights,
        )

    def dense(self) -> torch.Tensor:
        """``[B, V]`` float32, summed on the device by ``scatter_add_`` over the flattened table, which never reads
        the device back (``index_put_`` with ``accumulate=True`` sorts its indices, and on CUDA may wait for the
        device: tests/engine/test_device_reads.py)."""
        batch, vocab_size = self.shape
        device = self.ids.device
        weights = torch.ones(len(self.ids), device=device) if self.weights is None else self.weights
        table = torch.zeros(batch * vocab_size, device=device)
        return table.scatter_add_(0, self.rows * vocab_size + self.ids, weights).view(batch, vocab_size)


@dataclass(frozen=True)
class LogitAdjustments:
    """One step's penalties and biases, one row per request (rows that ask for none are neutral).

    presence, frequency: [B] float32 (0 = off); repetition: [B] float32 (1 = off)
    counted:             the occurrences of each token in each row's committed output (:attr:`output_counts`)
    prompted:            the tokens of the prompt of rows with a repetition penalty (:attr:`prompt_seen`), or
                         None when no row has one (the rule is then skipped: r = 1 changes nothing)
    biased:              the rows' logit biases (:attr:`bias`), or None when no row has one

    The dense tables are summed on the device when first read, so a :class:`Staging` that carries the entries
    may send after :meth:`build`.
    """

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    counted: TokenTable
    prompted: TokenTable | None
    biased: TokenTable | None

    @cached_property
    def output_counts(self) -> torch.Tensor:
        """[B, V] float32: occurrences of each token in the committed output."""
        return self.counted.dense()

    @cached_property
    def prompt_seen(self) -> torch.Tensor | None:
        """[B, V] bool: tokens of the prompt (rows with a repetition penalty), or None."""
        return None if self.prompted is None else self.prompted.dense() > 0

    @cached_property
    def bias(self) -> torch.Tensor | None:
        """[B, V] float32 logit biases, or None."""
        return None if self.biased is None else self.biased.dense()

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompts: list[list[int]],
        outputs: list[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        staging: Staging | None = None,
    ) -> LogitAdjustments:
        """The adjustments of a batch (per row: its params, prompt and committed output ids, each < V), sent in
        one copy, or in ``staging``'s (then the adjustments are read only once it has sent)."""
        own = staging is None
        staging = Staging(device) if own else staging
        shape = (len(params), vocab_size)
        adjusted = [b for b, p in enumerate(params) if p.adjusts_logits]  # the other rows stay zero: never read
        biases = {b: params[b].logit_bias for b in adjusted if params[b].logit_bias}
        # Only the repetition penalty reads the prompt: with r = 1 being seen changes nothing.
        repeating = {b: prompts[b] for b in adjusted if params[b].repetition_penalty != 1}
        adjustments = cls(
            *(staging.float32([getattr(p, name) for p in params]) for name in PENALTIES),
            counted=TokenTable.stage(shape, {b: outputs[b] for b in adjusted}, None, staging),
            prompted=TokenTable.stage(shape, repeating, None, staging) if repeating else None,
            biased=TokenTable.stage(
                shape,
                {b: list(bias) for b, bias in biases.items()},
                {b: list(bias.values()) for b, bias in biases.items()},
                staging,
            )
            if biases
            else None,
        )
        if own:
            staging.send()
        return adjustments

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
