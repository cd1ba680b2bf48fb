"""What a request returns, and the per-request text assembly behind it.

`TextAssembler` turns committed token ids into the reasoning text (inside `<think>…</think>`)
and the answer text, applies stop strings and EOS, and says what can be streamed so far;
`stream_delta` turns each commit into what a request gained, and `finish_output` closes its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.decoding.logprobs import TokenLogprob
from tandem.thinking import ThinkingTracker

INCOMPLETE_CHAR = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to


@dataclass
class GenerationStats:
    """Speculative-decoding counters of one request."""

    steps: int = 0  # target forward passes that produced tokens for this request
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per step: accepted drafts plus the target's own token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
        }


@dataclass
class RequestOutput:
    """A finished (or, when streamed, partial) request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # every generated token, markers included
    text: str = ""  # the answer: generated text after `</think>` (all of it if never thinking)
    reasoning: str = ""  # generated text inside `<think>…</think>`, markers excluded
    finish_reason: str | None = None  # "stop" | "length" | "grammar_dead_end" | "abort" | "error" | None (running)
    stats: GenerationStats = field(default_factory=GenerationStats)
    error: str | None = None  # why a request failed before generating (finish_reason "error")
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, if SamplingParams.logprobs asked
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """New text since the last delta of a request."""

    request_id: str
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, if SamplingParams.logprobs asked

    @property
    def has_content(self) -> bool:
        """Whether there is anything to show: text, reasoning or log-probabilities."""
        return bool(self.text or self.reasoning or self.logprobs)


class IncrementalDecoder:
    """The text of a growing list of token ids, decoding a few ids per new token, not the whole list.

    vLLM's incremental detokenization: the text the ids from `read` on add is the decode of
    ids[prefix:] minus the decode of ids[prefix:read], the ids before `read` giving the tokenizer
    its context (a leading space, bytes merged across tokens). While the new text ends in a
    partial character it waits for the next token.
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def add(self, token_id: int) -> str:
        """Append one token; returns the whole text so far."""
        self.ids.append(token_id)
        known = self._decode(self.ids[self._prefix : self._read])
        grown = self._decode(self.ids[self._prefix :])
        if len(grown) > len(known) and not grown.endswith(INCOMPLETE_CHAR):
            self.text += grown[len(known) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class TextAssembler:
    """Committed token ids -> reasoning and answer text, with EOS and stop strings.

    Each committed token is a thinking marker (dropped from the text), a reasoning token
    (inside `<think>…</think>`, as the row's ThinkingTracker says) or an answer token. Stop
    strings apply to the answer only: it ends right before the first occurrence, even inside a
    token. EOS ends the request and is not part of the text.
    """

    def __init__(self, tokenizer, *, eos_token_ids: set[int], tracker: ThinkingTracker | None, stop: list[str]) -> None:
        self._eos = eos_token_ids
        self._tracker = tracker
        self._markers = set() if tracker is None else {tracker.markers.open_id, tracker.markers.close_id}
        self._stop = stop
        self._reasoning = IncrementalDecoder(tokenizer)
        self._answer = IncrementalDecoder(tokenizer)
        self.reasoning = ""
        self.text = ""
        self.stopped_by: str | None = None  # "eos" | the stop string found

    def add(self, token_ids: list[int]) -> int:
        """Consume committed tokens until one ends the request; returns how many were consumed."""
        for consumed, token in enumerate(token_ids, start=1):
            if token in self._eos:
                self.stopped_by = "eos"
                return consumed
            thinking = self._tracker is not None and self._tracker.thinking
            if self._tracker is not None:
                self._tracker.commit([token])
            if token in self._markers:
                continue
            if thinking:
                self.reasoning = self._reasoning.add(token)
            elif self._add_answer_token(token):
                return consumed
        return len(token_ids)

    def _add_answer_token(self, token: int) -> bool:
        """Grow the answer by `token`; cut it at the first stop string, if one appeared."""
        previous = len(self.text)
        self.text = self._answer.add(token)
        longest = max((len(s) for s in self._stop), default=0)
        window_start = max(0, previous - longest + 1)
        hits = [(at, stop) for stop in self._stop if (at := self.text.find(stop, window_start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self.text = self.text[:at]
        self.stopped_by = stop
        return True

    def streamable(self) -> tuple[str, str]:
        """(reasoning, answer) text that is final: no partial character, and no answer suffix
        that could still grow into a stop string."""
        answer = self.text
        if self.stopped_by is None:
            held = max((n for s in self._stop for n in range(1, len(s)) if answer.endswith(s[:n])), default=0)
            answer = answer[: len(answer) - held]
        return self.reasoning, answer


def stream_delta(
    output: RequestOutput,
    text: TextAssembler,
    emitted: list[int],
    logprobs: list[TokenLogprob] | None,
    reason: str | None,
) -> StreamDelta:
    """What one commit of `emitted` tokens added to the request, recorded in its `output`. While it
    runs, only the text that is final streams; the commit that finishes it hands out the rest."""
    reasoning, answer = text.streamable() if reason is None else (text.reasoning, text.text)
    delta = StreamDelta(
        output.request_id,
        text=answer[len(output.text) :],
        reasoning=reasoning[len(output.reasoning) :],
        token_ids=emitted,
        finish_reason=reason,
        logprobs=logprobs,
    )
    output.text, output.reasoning = answer, reasoning
    output.token_ids.extend(emitted)
    if logprobs is not None:
        output.logprobs.extend(logprobs)
    return delta


def finish_output(output: RequestOutput, text: TextAssembler, reason: str) -> None:
    """Close a request's output: its finish reason, and all of its text."""
    output.finish_reason = reason
    output.text, output.reasoning = text.text, text.reasoning
