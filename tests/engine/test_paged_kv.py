"""The paged KV cache in the engine, on the shipped demo models (fp32): small blocks give, token for token, the
greedy outputs of one block per row (the contiguous layout) for every pair, speculative and plain, with and
without a JSON schema (graph mode: test_paged_graphs.py); a pool too small for every request at once finishes them all
with the same outputs (waiting and preemption); a request that shares a long prefix with an earlier one
prefills only its new tokens and outputs what it outputs without the prefix cache, model drafts included."""

from __future__ import annotations

import pytest

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.engine.engine import Engine, EngineConfig
from tandem.llm import chat_prompt_ids

# Prompts of 323, 30, 48 and 62 tokens; the first and the last begin with the same chat template and tools, and
# the last is admitted after the first whatever grammars are still compiling.
EXAMPLES = [generate_examples(6, seed=11, split="heldout")[i] for i in (0, 2, 5, 3)]
MAX_TOKENS = 12
MAX_LEN = 384
PAIRS = [
    ("demo-llama", "eagle3"),
    ("demo-llama", "eagle"),
    ("demo-llama", "ngram"),
    ("demo-llama", None),
    ("demo-deepseek", "mtp"),
    ("demo-deepseek", None),
]


@pytest.fixture(autouse=True)
def _dynamo_only(monkeypatch):
    monkeypatch.setenv("TANDEM_COMPILE_BACKEND", "eager")


def _engine(models, name: str, draft: str | None, **config) -> Engine:
    target, draft_model, tokenizer = models(name, draft)
    settings = dict(max_num_seqs=2, max_model_len=MAX_LEN, graph_mode="eager", block_size=4, adaptive=False)
    return Engine(target, draft_model, tokenizer, EngineConfig(**{**settings, **config}))


def _params(schema_every: int = 2) -> list[SamplingParams]:
    """Greedy params per example; the second of every `schema_every` with its family's JSON schema."""
    return [
        SamplingParams(
            max_tokens=MAX_TOKENS, json_schema=TASK_FAMILIES[e.family].schema if i % schema_every == 1 else None
        )
        for i, e in enumerate(EXAMPLES)
    ]


def _prompts(engine: Engine) -> list[list[int]]:
    return [chat_prompt_ids(engine.tokenizer, e.messages, e.tools) for e in EXAMPLES]


def _generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Token ids of each prompt, all queued at once (the engine batches max_num_seqs of them at a time)."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(request_id).token_ids for request_id in ids]


def _assert_pool_whole(engine: Engine) -> None:
    stats = engine.kv_stats()
    assert stats.blocks_in_use == 0, stats
    assert all(not row for row in engine.blocks.table.rows)
    assert all(ref == 0 for ref in engine.blocks.ref)


@pytest.mark.parametrize("name, draft", PAIRS, ids=[f"{n}+{d}" for n, d in PAIRS])
def test_paged_blocks_give_the_contiguous_outputs(models, name, draft):
    """Blocks of 4 positions (many per row, rows sharing their prompts' cached blocks) against one block of
    max_model_len per row (the contiguous layout, which never fills a block to cache): the same tokens."""
    paged = _engine(models, name, draft)
    contiguous = _engine(models, name, draft, block_size=MAX_LEN)
    prompts, params = _prompts(paged), _params()
    outputs = _generate(paged, prompts, params)
    assert outputs == _generate(contiguous, prompts, params)
    assert paged.kv_stats().prefix_hit_tokens > 0  # the later prompts reused the chat template's blocks
    assert contiguous.kv_stats().prefix_hit_tokens == 0
    _assert_pool_whole(paged)
    _assert_pool_whole(contiguous)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["uncached", "cached"])
def test_a_pool_too_small_for_every_request_waits_and_preempts_with_the_same_outputs(models, prefix_caching):
    """A pool of one full row: requests wait for blocks, running rows are preempted and recomputed (the
    323-token prompt and a short one fit at admission, not once both grow), and every request ends with the
    tokens a roomy pool gives. With prefix caching, a preempted row takes back its own registered blocks."""
    roomy = _engine(models, "demo-llama", "eagle3", enable_prefix_caching=False)
    per_position = roomy.target_cache.bytes_per_position + roomy.draft_cache.bytes_per_position
    memory = per_position * MAX_LEN
    tight = _engine(models, "demo-llama", "eagle3", enable_prefix_caching=prefix_caching, kv_cache_memory=memory)
    assert tight.kv_stats().blocks_total == MAX_LEN // 4
    prompts, params = _prompts(roomy), _params()
    assert _generate(tight, prompts, params) == _generate(roomy, prompts, params)
    assert tight.kv_stats().preemptions > 0
    assert roomy.kv_stats().preemptions == 0
    _assert_pool_whole(tight)


def test_a_pool_smaller_than_one_row_is_refused(models):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        _engine(models, "demo-llama", None, kv_cache_memory=1024)


@pytest.mark.parametrize("name, draft", [("demo-llama", "eagle3"), ("demo-deepseek", "mtp")])
def test_a_shared_prefix_is_prefilled_once_and_outputs_are_unchanged(models, name, draft):
    """Two turns that share a 300-token prefix, one after the other: the second prefills only what follows the
    cached blocks (and the last cached position again, whose hidden state the draft needs), and both output
    exactly what an engine without the prefix cache outputs."""
    cached = _engine(models, name, draft)
    uncached = _engine(models, name, draft, enable_prefix_caching=False)
    prefix = _prompts(cached)[0]
    first, second = prefix + [418, 416, 206], prefix[:-7] + [870, 295, 871, 531, 458]
    fed: list[list[int]] = []
    forward = cached._forward

    def counting(batch, **options):
        fed.append(batch.spans.lengths)
        return forward(batch, **options)

    cached._forward = counting
    params = [SamplingParams(max_tokens=MAX_TOKENS)]
    outputs = [_generate(cached, [first], params)]
    request = cached.add_request(second, params[0])
    cached.step()  # the second turn's prefill
    reused = next(r for r in cached.scheduler.running if r.request_id == request).output.num_cached_tokens
    assert reused == (len(prefix) - 7) // 4 * 4  # its full blocks that the first turn holds too
    assert fed[-1] == [len(second) - reused + 1]
    while cached.has_unfinished():
        cached.step()
    output = cached.pop_finished(request)
    assert output.num_cached_tokens == reused
    outputs.append([output.token_ids])
    assert outputs == [_generate(uncached, [p], params) for p in (first, second)]
    assert uncached.kv_stats().prefix_hit_tokens == 0
    _assert_pool_whole(cached)


def test_aborted_rows_running_or_waiting_give_every_block_back(models):
    """Abort a running row and a waiting one in a pool too small for all four requests: the others end with their
    roomy-pool tokens, and the pool is whole again."""
    roomy = _engine(models, "demo-llama", None, enable_prefix_caching=False)
    memory = roomy.target_cache.bytes_per_position * MAX_LEN
    tight = _engine(models, "demo-llama", None, kv_cache_memory=memory, max_num_seqs=3)
    prompts, params = _prompts(tight), [SamplingParams(max_tokens=MAX_TOKENS)] * 4
    ids = [tight.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    tight.step()
    tight.step()
    running = [r.request_id for r in tight.scheduler.running]
    tight.abort(running[-1])
    tight.abort(tight.scheduler.waiting[-1].request_id)
    while tight.has_unfinished():
        tight.step()
    outputs = {i: tight.pop_finished(i) for i in ids}
    done = [i for i, o in outputs.items() if o.finish_reason != "abort"]
    assert len(done) == 2
    expected = _generate(roomy, [prompts[ids.index(i)] for i in done], params[:2])
    assert [outputs[i].token_ids for i in done] == expected
    _assert_pool_whole(tight)
