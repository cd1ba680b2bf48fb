"""Response bodies and streaming chunks of the OpenAI-compatible API, built from engine outputs.

Reasoning (text inside `<think>…</think>`) is returned as `reasoning_content` and, for clients
that read the newer name, `reasoning`; the answer is `content`. Speculative-decoding counters
ride along in the extra top-level field `speculative_decoding` (non-streaming responses and the
streaming usage chunk). Log-probabilities, when asked for, cover every generated token, the
reasoning's included (as vLLM's do).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.decoding.logprobs import TokenLogprob
from tandem.engine.output import GenerationStats, RequestOutput
from tandem.serve import tools
from tandem.serve.protocol import Tool


@dataclass(frozen=True)
class ResponseContext:
    """What every body of one response repeats: its id, creation time and model, and the draft."""

    object_prefix: str  # "chatcmpl" | "cmpl"
    model: str
    draft: str | None
    num_speculative_tokens: int
    token_text: Callable[[int], str]  # a token id's text, for log-probabilities
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", f"{self.object_prefix}-{uuid.uuid4().hex}")
        object.__setattr__(self, "created", int(time.time()))

    def envelope(self, object_type: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_type, "created": self.created, "model": self.model}

    def speculative(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The summed speculative-decoding counters of `outputs`, with the draft that produced them."""
        total = GenerationStats()
        for output in outputs:
            total.steps += output.stats.steps
            total.drafted += output.stats.drafted
            total.accepted += output.stats.accepted
        rate = total.accepted / total.drafted if total.drafted else 0.0
        return {
            "draft": self.draft,
            "num_speculative_tokens": self.num_speculative_tokens,
            **total.as_dict(),
            "acceptance_rate": round(rate, 4),
        }


def usage(prompt_tokens: int, outputs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI usage counts; completion tokens include reasoning and thinking markers; `cached_tokens`: the
    prompt tokens the prefix cache served (the most any choice's row found)."""
    completion = sum(len(output.token_ids) for output in outputs)
    cached = max((output.num_cached_tokens for output in outputs), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_logprobs(ctx: ResponseContext, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}` (None if not asked)."""
    if entries is None:
        return None

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [{**token(e.token_id, e.logprob), "top_logprobs": [token(*top) for top in e.top]} for e in entries]
    }


def completion_logprobs(
    ctx: ResponseContext, entries: list[TokenLogprob] | None, offset: int = 0
) -> dict[str, Any] | None:
    """A text completion choice's legacy `logprobs` (None if not asked); `offset`: the text before these tokens."""
    if entries is None:
        return None
    tokens = [ctx.token_text(e.token_id) for e in entries]
    starts = list(itertools.accumulate(map(len, tokens[:-1]), initial=offset)) if tokens else []
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{ctx.token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": starts,
    }


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """The reasoning under both names clients read it by (empty dict for no reasoning)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}


def chat_message(output: RequestOutput, call_tools: list[Tool]) -> tuple[dict[str, Any], str]:
    """The assistant message of one choice and its finish reason; an answer that is a call of one of
    `call_tools` becomes `tool_calls` with finish reason "tool_calls"."""
    call = tools.parse_call(output.text, call_tools) if call_tools and output.finish_reason == "stop" else None
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if call else output.text,
        **reasoning_fields(output.reasoning),
    }
    if call is not None:
        message["tool_calls"] = [call]
        return message, "tool_calls"
    return message, output.finish_reason


def chat_completion(
    ctx: ResponseContext, prompt_tokens: int, outputs: list[RequestOutput], call_tools: list[Tool]
) -> dict[str, Any]:
    """A `chat.completion` body; choice i is outputs[i]."""
    choices = []
    for index, output in enumerate(outputs):
        message, finish_reason = chat_message(output, call_tools)
        choices.append(
            {
                "index": index,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": chat_logprobs(ctx, output.logprobs),
            }
        )
    return {
        **ctx.envelope("chat.completion"),
        "choices": choices,
        "usage": usage(prompt_tokens, outputs),
        "speculative_decoding": ctx.speculative(outputs),
    }


def chat_chunk(
    ctx: ResponseContext,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """A `chat.completion.chunk` carrying one choice's delta (and its tokens' log-probabilities)."""
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": chat_logprobs(ctx, logprobs)}
    return {**ctx.envelope("chat.completion.chunk"), "choices": [choice]}


def completion_choice(
    index: int, text: str, reasoning: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One `text_completion` choice; reasoning, if the model thought, under the chat names."""
    return {
        "index": index,
        "text": text,
        **reasoning_fields(reasoning),
        "finish_reason": finish_reason,
        "logprobs": logprobs,
    }


def completion(ctx: ResponseContext, prompt_tokens: int, outputs: list[RequestOutput]) -> dict[str, Any]:
    """A `text_completion` body; choice i is outputs[i]."""
    choices = [
        completion_choice(i, out.text, out.reasoning, out.finish_reason, completion_logprobs(ctx, out.logprobs))
        for i, out in enumerate(outputs)
    ]
    return {
        **ctx.envelope("text_completion"),
        "choices": choices,
        "usage": usage(prompt_tokens, outputs),
        "speculative_decoding": ctx.speculative(outputs),
    }


def usage_chunk(
    ctx: ResponseContext, object_type: str, prompt_tokens: int, outputs: list[RequestOutput]
) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, usage and stats."""
    return {
        **ctx.envelope(object_type),
        "choices": [],
        "usage": usage(prompt_tokens, outputs),
        "speculative_decoding": ctx.speculative(outputs),
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` (or a literal such as [DONE]) and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"
