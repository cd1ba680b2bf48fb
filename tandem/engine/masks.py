"""The step's masks (step 3) and the grammar walk a draft proposes under (step 6).

A step needs grammar bitmasks when one of its rows has a grammar, and thinking phases when relaxed
acceptance is on and the tokenizer has thinking markers; a step that needs neither builds nothing.
The masks come from one of two places:

- the draft's walk: when every row verifies exactly the drafts its grammar walk went through at the
  last propose, that walk already wrote the masks `SpeculativeMasker.fill` would (it is the same
  walk), so the step takes them;
- else the `MaskPipeline`, which builds them on its worker thread while the target's forward runs.

The masker (`tandem.grammars.masks`) holds each row's grammar state; this module only decides where
a step's masks come from and keeps the walked ones for the next verify.
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
    ) -> None:
        self.masker, self.pipeline, self.k, self.device = masker, pipeline, k, device
        self.relaxed = relaxed  # relaxed acceptance reads the thinking phases
        self.thinking_markers = thinking_markers  # without them no position is thinking
        # Scratch the draft's walk writes; each row keeps a copy of its own for the next verify.
        self._walk_bitmask = torch.zeros(max_rows, k + 1, masker.width, dtype=torch.int32)
        self._walk_thinking = torch.zeros(max_rows, k + 1, dtype=torch.bool)

    def has_grammar(self, rows: list[Request]) -> bool:
        return any(self.masker.has_grammar(r.request_id) for r in rows)

    def submit(self, rows: list[Request], drafts: torch.Tensor) -> PendingMasks | None:
        """Start building this step's masks (drafts [B, k] CPU); None when no row has a grammar and
        relaxed acceptance is off (or has no thinking to read)."""
        any_grammar = self.has_grammar(rows)
        if not any_grammar and not (self.relaxed and self.thinking_markers):
            return None
        if all(r.walked_masks is not None for r in rows):  # built while drafting: `fill` is that same walk
            bitmask, in_thinking = (torch.stack(masks) for masks in zip(*(r.walked_masks for r in rows)))
            return PendingMasks(MaskHandle.ready(bitmask, in_thinking, self.device), any_grammar)
        return PendingMasks(self.pipeline.submit([r.request_id for r in rows], drafts), any_grammar)

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
            self.masker, [r.request_id for r in rows], self.k, self._walk_bitmask, self._walk_thinking, self.device
        )

    def walked(self, walk: MaskWalk | None, b: int, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Row b's masks from the walk, for its next verify: only when the row keeps all k drafts,
        the very tokens the walk went through (a shorter row gets its masks from the pipeline)."""
        if walk is None or num_drafts != self.k:
            return None
        return walk.bitmask[b].clone(), walk.in_thinking[b].clone()
