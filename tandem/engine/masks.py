"""The step's masks (step 3) and the grammar walk a draft proposes under (step 6).

A step needs grammar bitmasks when one of its rows has a grammar, and thinking phases when relaxed
acceptance is on and the tokenizer has thinking markers; a step that needs neither builds nothing.
The masks come from one of two places:

- the draft's walk: when every row verifies drafts its grammar walk went through at the last propose
  (a prefix of the walk's path), that walk already wrote the masks `SpeculativeMasker.fill` would (it
  is the same walk), so the step takes them;
- else the `MaskPipeline`, which builds them on its worker thread while the target's forward runs (on the
  CPU, which runs the forward itself, before it).

The masker (`tandem.grammars.masks`) holds each row's grammar state; this module only decides where
a step's masks come from and keeps the walked ones for the next verify.

Widths: `k` here is the widest verify a step may run, the draft's k plus the forced drafts allowed
beyond it (`EngineConfig.max_forced_drafts`); a step's masks cover its widest row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.engine.mask_pipeline import MaskHandle, MaskPipeline
from tandem.engine.request import Request
from tandem.grammars.masks import MaskWalk, SpeculativeMasker


class PendingMasks(NamedTuple):
    """A step's masks in the making."""

    handle: MaskHandle
    any_grammar: bool  # whether a row has a grammar (else only the thinking phases are wanted)


class StepMasks:
    """Where each step's verify masks come from, and the draft's walks that can provide them."""

    def __init__(
        self,
        masker: SpeculativeMasker,
        pipeline: MaskPipeline,
        *,
        k: int,
        max_rows: int,
        relaxed: bool,
        thinking_markers: bool,
        device: torch.device,
        detect_forced: bool = False,
    ) -> None:
        self.masker, self.pipeline, self.k, self.device = masker, pipeline, k, device
        self.relaxed = relaxed  # relaxed acceptance reads the thinking phases
        self.thinking_markers = thinking_markers  # without them no position is thinking
        self.detect_forced = detect_forced  # walks record forced tokens (grammar-forced drafting)
        self.closing = masker.closer is not None  # masks close answers within their budgets
        # Scratch the draft's walk writes; each row keeps a copy of its own for the next verify.
        self._walk_bitmask = torch.zeros(max_rows, k + 1, masker.width, dtype=torch.int32)
        self._walk_thinking = torch.zeros(max_rows, k + 1, dtype=torch.bool)

    @property
    def reads_drafts(self) -> bool:
        """Whether every step's masks read its drafts' values, grammar or not: the thinking phases they enter."""
        return self.relaxed and self.thinking_markers

    def has_grammar(self, rows: list[Request]) -> bool:
        return any(self.masker.has_grammar(r.request_id) for r in rows)

    def submit(self, rows: list[Request], drafts: torch.Tensor) -> PendingMasks | None:
        """Start building this step's masks (drafts [B, w] CPU, w <= k: the masks are [B, w+1, W]);
        None when no row has a grammar and relaxed acceptance is off (or has no thinking to read)."""
        any_grammar = self.has_grammar(rows)
        if not any_grammar and not self.reads_drafts:
            return None
        if all(r.walked_masks is not None for r in rows):  # built while drafting: `fill` is that same walk
            positions = drafts.shape[1] + 1
            bitmask = self.masker.base_row.repeat(len(rows), positions, 1)
            in_thinking = torch.zeros(len(rows), positions, dtype=torch.bool)
            for b, r in enumerate(rows):
                # `fill` past a row's drafts (placeholders) keeps the phase after its last draft, and writes
                # the thinking row there for a grammar row that is thinking, else the base row.
                walked, thinking = r.walked_masks
                if thinking[-1] and self.masker.has_grammar(r.request_id):
                    bitmask[b, len(walked) :] = self.masker.thinking_row
                bitmask[b, : len(walked)] = walked
                in_thinking[b] = thinking[-1]
                in_thinking[b, : len(thinking)] = thinking
            return PendingMasks(MaskHandle.ready(bitmask, in_thinking, self.device), any_grammar)
        return PendingMasks(
            self.pipeline.submit([r.request_id for r in rows], drafts, self.remaining(rows)), any_grammar
        )

    def remaining(self, rows: list[Request]) -> list[int | None] | None:
        """Each row's tokens left (closing masks), None when closing is off."""
        return [r.params.max_tokens - r.num_generated for r in rows] if self.closing else None

    def wait(self, pending: PendingMasks | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Grammar bitmasks [B, k+1, W] (None when no row has a grammar) and thinking phases [B, k+1]
        (None when relaxed acceptance is off), on the device."""
        if pending is None:
            return None, None
        bitmask, in_thinking, _ = pending.handle.wait()
        return bitmask if pending.any_grammar else None, in_thinking if self.relaxed else None

    def walk(self, rows: list[Request]) -> MaskWalk | None:
        """The walk a draft that follows the grammar proposes under, None when no row has a grammar.
        The caller must `finish` it before anything commits to the masker."""
        if not self.has_grammar(rows):
            return None
        return MaskWalk(
            self.masker,
            [r.request_id for r in rows],
            self.k,
            self._walk_bitmask,
            self._walk_thinking,
            self.device,
            detect_forced=self.detect_forced,
            remaining=self.remaining(rows),
        )

    def walked(self, walk: MaskWalk | None, b: int, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Row b's masks from the walk for its next verify ([num_drafts + 1, W], [num_drafts + 1]): its
        drafts must be the first `num_drafts` tokens of the walk's path for that row."""
        if walk is None:
            return None
        return walk.bitmask[b, : num_drafts + 1].clone(), walk.in_thinking[b, : num_drafts + 1].clone()
