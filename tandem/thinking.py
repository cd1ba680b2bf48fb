"""ThinkingTracker: per-row reasoning phase over token ids, and per-position phases for a draft window.

A row is *thinking* between `<think>` and `</think>` (ids from the tokenizer, never hard-coded).
Phase of position i = the state after the committed tokens and the first i tokens of the window;
a token reaches the grammar iff the phase at its position is not thinking. So the closing marker
itself (emitted while thinking) never reaches the grammar, and every token after it does, within
the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ThinkingMarkers:
    """Token ids of the reasoning markers."""

    open_id: int
    close_id: int

    @classmethod
    def from_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, open_text: str = "<think>", close_text: str = "</think>"
    ) -> ThinkingMarkers:
        """Look both markers up as single tokens; raises ValueError naming a marker the tokenizer lacks."""
        ids = []
        for text in (open_text, close_text):
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            if len(token_ids) != 1:
                raise ValueError(f"tokenizer has no single token for {text!r} (encodes to {token_ids})")
            ids.append(token_ids[0])
        return cls(*ids)


class ThinkingTracker:
    """One row's reasoning phase; advanced only by committed tokens.

    Start state: the last marker in the prompt decides (a prompt ending inside `<think>` starts in
    thinking). `expect_reasoning=True` starts in thinking when the prompt has no marker at all, for
    models that open their own `<think>` (the grammar must stay off until `</think>`).
    """

    def __init__(self, markers: ThinkingMarkers, prompt_tokens: Sequence[int] = (), *, expect_reasoning: bool = False):
        self.markers = markers
        self.thinking = expect_reasoning
        self.commit(prompt_tokens)

    def phases(self, tokens: Sequence[int]) -> list[bool]:
        """Phase at each of the len(tokens)+1 positions of a window; does not change state.

        Returns [thinking before tokens[0], after tokens[0], ..., after tokens[-1]].
        """
        state, out = self.thinking, [self.thinking]
        for token in tokens:
            if token == self.markers.open_id:
                state = True
            elif token == self.markers.close_id:
                state = False
            out.append(state)
        return out

    def commit(self, tokens: Sequence[int]) -> list[int]:
        """Advance by committed `tokens` (mutates); returns those that reach the grammar, in order."""
        phases = self.phases(tokens)
        self.thinking = phases[-1]
        return [t for t, thinking in zip(tokens, phases) if not thinking]
