"""Interchangeable model providers: targets verify, drafts propose (see :mod:`tandem.models.base`)."""

from tandem.models.base import (
    Draft,
    DraftConstraint,
    DraftInput,
    DraftProposal,
    ForwardBatch,
    KVCache,
    RowSpans,
    Target,
    TargetOutput,
    default_aux_layer_ids,
)
from tandem.models.loading import CheckpointError, WeightReader, load_draft, load_target, load_tokenizer

__all__ = [
    "CheckpointError",
    "Draft",
    "DraftConstraint",
    "DraftInput",
    "DraftProposal",
    "ForwardBatch",
    "KVCache",
    "RowSpans",
    "Target",
    "TargetOutput",
    "WeightReader",
    "default_aux_layer_ids",
    "load_draft",
    "load_target",
    "load_tokenizer",
]
