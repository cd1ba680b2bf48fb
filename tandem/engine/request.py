"""One request inside the engine: the checks it passes before it is queued, and its state from
`Engine.add_request` to its last commit."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.decoding.params import SamplingParams
from tandem.engine.output import RequestOutput, TextAssembler
from tandem.grammars.compiler import CompileJob
from tandem.grammars.spec import GrammarSpec
from tandem.thinking import ThinkingMarkers, ThinkingTracker


class PromptTooLongError(ValueError):
    """A prompt that leaves no room to generate within the engine's context length."""


@dataclass
class Undrafted:
    """Committed tokens a row's draft has not taken yet (steps where no row drafted): positions ``start ..
    end - 1``, and the target's hidden states before each, ``hidden [end - start, H]``."""

    start: int
    hidden: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + len(self.hidden)


@dataclass
class Request:
    """Engine-side state of one request."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    text: TextAssembler
    grammar_job: CompileJob | None = None  # the request's grammar, compiling off the step loop
    tokens: list[int] = field(default_factory=list)  # prompt + committed output
    drafts: list[int] = field(default_factory=list)  # pending drafts for the next verify
    # A chained draft's proposal left on the device, never read back: (tokens [B, passes], this row's index); `drafts`
    # then holds only their number (placeholders), and the verify takes the values there (`verify_inputs`).
    drafts_on_device: tuple[torch.Tensor, int] | None = None
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] or None (deterministic)
    draft_forced: list[bool] = field(default_factory=list)  # per draft: forced by the grammar (accepted surely)
    forced_run: int = 0  # the last drafts: the forced run verified past the chosen ones
    asked_drafts: int = 0  # the drafts adaptive speculation asked of the draft for the next verify (it may have fewer)
    # The drafts' verify masks from the draft's grammar walk: (bitmask [k+1, W], in_thinking [k+1])
    walked_masks: tuple[torch.Tensor, torch.Tensor] | None = None
    undrafted: Undrafted | None = None  # what the draft has not taken (engine.batching.defer_draft)
    slot: int = -1  # its KV-cache slot while it runs; -1 while it waits or once it finished
    output: RequestOutput | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def clear_drafts(self) -> None:
        """Forget the pending drafts and what came with them (verified, or dropped by a preemption)."""
        self.drafts, self.draft_probs, self.walked_masks, self.draft_forced, self.forced_run = [], None, None, [], 0
        self.asked_drafts, self.drafts_on_device = 0, None


def validate(prompt: list[int], params: SamplingParams, *, max_model_len: int, k: int, vocab_size: int) -> None:
    """Raise PromptTooLongError if the prompt leaves no room for one step (its k + 1 tokens are reserved
    for speculation), ValueError for an empty prompt or a token id (prompt or logit bias) outside the
    vocabulary."""
    if not prompt:
        raise ValueError("prompt is empty: give at least one token")
    room = max_model_len - len(prompt) - k - 1
    if room < 1:
        raise PromptTooLongError(
            f"prompt has {len(prompt)} tokens; the context is {max_model_len} tokens "
            f"({k + 1} reserved for speculation), so nothing can be generated"
        )
    for what, ids in (("prompt", prompt), ("SamplingParams.logit_bias", params.logit_bias or {})):
        outside = next((i for i in ids if not 0 <= i < vocab_size), None)
        if outside is not None:
            raise ValueError(f"{what}: token id {outside} is outside the vocabulary [0, {vocab_size})")


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The request's constraint as a GrammarSpec; `grammar` is GBNF/EBNF when it parses as such, else Lark.
    A JSON schema's whitespace is bounded by `params.json_whitespace`."""
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema, whitespace=params.json_whitespace)
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.choice is not None:
        return GrammarSpec.choice(params.choice)
    if params.grammar is not None:
        return GrammarSpec.grammar(params.grammar)
    return None


def thinking_markers(tokenizer) -> ThinkingMarkers | None:
    """The tokenizer's `<think>` / `</think>` ids, or None if it has no such single tokens."""
    try:
        return ThinkingMarkers.from_tokenizer(tokenizer)
    except ValueError:
        return None


def thinking_tracker(markers: ThinkingMarkers | None, prompt: list[int]) -> ThinkingTracker | None:
    """A fresh tracker of the thinking phase after `prompt` (None without markers); each consumer
    (the text assembler, the grammar row) advances its own."""
    return None if markers is None else ThinkingTracker(markers, prompt)
