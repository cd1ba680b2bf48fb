"""Chunked prefill on the shipped demo models (fp32): with a step budget of a few dozen tokens, prompts of 30 to 323
tokens are prefilled over several steps and every request outputs, token for token, what the unchunked engine
outputs, its drafts accepted as often (the draft's cache is whole when the last chunk proposes), grammar rows
included; short rows that decode while a long prompt arrives emit a token every step of its prefill."""

from __future__ import annotations

import pytest

from tandem.decoding.params import SamplingParams
from tandem.engine.engine import Engine, EngineConfig
from tests.engine.test_paged_kv import _assert_pool_whole, _engine, _params, _prompts

PAIRS = [("demo-llama", "eagle3"), ("demo-llama", None), ("demo-deepseek", "mtp")]


@pytest.fixture(autouse=True)
def _dynamo_only(monkeypatch):
    monkeypatch.setenv("TANDEM_COMPILE_BACKEND", "eager")


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, int, set[int]]:
    """Each request's (token ids, drafted, accepted), all queued at once; the steps that fed a chunk; the indices
    of the requests prefilled in chunks."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    chunk_steps, chunked = 0, set()
    while engine.has_unfinished():
        engine.step()
        chunk_steps += bool(engine.scheduler.chunk_ends)
        chunked |= {ids.index(i) for i in engine.scheduler.chunk_ends}
    outputs = [engine.pop_finished(i) for i in ids]
    return [(o.token_ids, o.stats.drafted, o.stats.accepted) for o in outputs], chunk_steps, chunked


@pytest.mark.parametrize("name, draft", PAIRS, ids=[f"{n}+{d}" for n, d in PAIRS])
def test_chunked_prefill_gives_the_unchunked_outputs(models, name, draft):
    """A 24-token budget against none: the 323-token prompt and the 30-token one under a JSON schema's grammar go in
    chunks (the last prompt after the chat template's cached blocks); the same tokens, the same drafts accepted,
    and a whole pool at the end."""
    chunked = _engine(models, name, draft, max_num_batched_tokens=24)
    whole = _engine(models, name, draft, max_num_batched_tokens=None)
    prompts, params = _prompts(chunked), _params()
    got, chunk_steps, chunked_rows = _run(chunked, prompts, params)
    expected, no_chunks, _ = _run(whole, prompts, params)
    assert got == expected
    assert chunk_steps >= 323 // 24 and no_chunks == 0
    assert {0, 1} <= chunked_rows and params[1].json_schema is not None
    assert chunked.kv_stats().prefix_hit_tokens > 0
    _assert_pool_whole(chunked)


def test_short_rows_keep_decoding_while_a_long_prompt_prefills(models):
    """Two short rows decode (plain steps); a 323-token prompt arrives: while it is prefilled in chunks each short
    row gains a token every step, and every request ends with the tokens of the unchunked engine fed the same way."""
    prompts = _prompts(_engine(models, "demo-llama", None))
    params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24), SamplingParams(max_tokens=8)]

    def run(engine: Engine) -> tuple[list[list[int]], int]:
        short = [engine.add_request(prompts[i], p) for i, p in zip((1, 3), params)]
        for _ in range(4):
            engine.step()
        rows = list(engine.scheduler.running)
        assert all(engine.target_cache.lengths[r.slot] == len(r.tokens) - 1 for r in rows)  # decoding
        long = engine.add_request(prompts[0], params[2])
        chunk_steps = 0
        while engine.has_unfinished():
            before = {r.request_id: len(r.tokens) for r in rows if r.output.finish_reason is None}
            engine.step()
            if long in engine.scheduler.chunk_ends:
                chunk_steps += 1
                assert all(len(r.tokens) > before[r.request_id] for r in rows if r.request_id in before), "a stall"
        return [engine.pop_finished(i).token_ids for i in (*short, long)], chunk_steps

    chunked = _engine(models, "demo-llama", None, max_num_seqs=3, max_num_batched_tokens=32)
    whole = _engine(models, "demo-llama", None, max_num_seqs=3, max_num_batched_tokens=None)
    got, chunk_steps = run(chunked)
    expected, no_chunks = run(whole)
    assert got == expected
    assert chunk_steps >= (323 - 62) // 32 and no_chunks == 0  # its cached prefix is shorter than the 62-token prompt
    _assert_pool_whole(chunked)


def test_chunked_prefill_in_graph_mode_gives_the_eager_unchunked_outputs(models):
    """Graph mode (CPU: dynamo's ``eager`` backend): chunks and prefills run eagerly, the rows' verify and draft
    steps through the graphs, and the outputs and accepted drafts are those of eager unchunked steps."""
    compiled = _engine(
        models, "demo-llama", "eagle3", graph_mode="compiled", capture_sizes=(1, 2), max_num_batched_tokens=24
    )
    eager = _engine(models, "demo-llama", "eagle3", max_num_batched_tokens=None)
    prompts, params = _prompts(compiled), _params()
    got, chunk_steps, _ = _run(compiled, prompts, params)
    assert got == _run(eager, prompts, params)[0]
    assert chunk_steps >= 323 // 24 and compiled.runner.replays > 0
    _assert_pool_whole(compiled)


@pytest.mark.parametrize("draft", ["eagle3", "ngram"])
def test_a_draft_with_no_tokens_to_propose_is_refused(models, draft):
    """k = 0 with a draft: EAGLE-3's proposal would still write its cache past the row's blocks."""
    target, draft_model, tokenizer = models("demo-llama", draft)
    with pytest.raises(ValueError, match="num_speculative_tokens = 0 with a draft"):
        Engine(target, draft_model, tokenizer, EngineConfig(num_speculative_tokens=0))


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "block_size", "max_num_seqs", "max_model_len"])
def test_a_config_without_room_for_a_token_is_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field} = 0 must be at least 1"):
        EngineConfig(**{field: 0})
