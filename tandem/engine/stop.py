"""The commit's stop rules (step 5): what a row keeps of the tokens it emitted, and why it finishes.

A row keeps its emitted tokens up to `max_tokens` in all, and none after the one that ends it: EOS,
one of its stop token ids, or the token that completes a stop string (its `TextAssembler` reads
them). It then finishes, in this order of precedence, with

- "stop": EOS, a stop token or a stop string ended it, or its grammar terminated;
- "grammar_dead_end": the grammar allowed no token where it had to emit one, and nothing above cut
  the emitted tokens first;
- "length": it reached `max_tokens`, or the context has no room left for another step's k + 1
  tokens (the room `Engine.add_request` reserves).

`draft_budget` holds the drafts to the same limits, so that a fully accepted run never overshoots them.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.engine.request import Request


def eos_ids(tokenizer, generation_eos: Iterable[int] = ()) -> set[int]:
    """The ids that end every request: the tokenizer's EOS and the model's `generation_eos` (the
    `eos_token_id` list of its generation_config.json, e.g. Llama 3.1 Instruct's end of turn and of
    message besides the end of text: `EngineConfig.eos_token_ids`, which `tandem.LLM` reads)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return ids | set(generation_eos)


def kept_tokens(r: Request, emitted: list[int]) -> list[int]:
    """The emitted tokens the row commits; its text takes them in (mutates `r.text`)."""
    emitted = emitted[: r.params.max_tokens - r.num_generated]
    consumed = r.text.add(emitted)
    return emitted[:consumed]


def finish_reason(r: Request, *, grammar_terminated: bool, dead_end: bool, k: int, max_model_len: int) -> str | None:
    """Why the row finishes after its commit, None if it goes on. `dead_end`: the grammar allowed nothing
    where the row had to emit and it kept every token it emitted (no other rule cut it first)."""
    if r.text.stopped_by is not None or grammar_terminated:
        return "stop"
    if dead_end:
        return "grammar_dead_end"
    if r.num_generated >= r.params.max_tokens or len(r.tokens) + k + 1 > max_model_len:
        return "length"
    return None


def draft_budget(r: Request, k: int, max_model_len: int) -> int:
    """How many drafts the row may verify next: its accepted run plus the bonus token stay within
    `max_tokens` and the context."""
    return max(min(r.params.max_tokens - r.num_generated - 1, max_model_len - len(r.tokens) - 1, k), 0)
