"""Async scheduling (engine/in_flight.py): a plain decode step launched before the previous one's tokens are read
gives, token for token, the synchronous engine's outputs (greedy and seeded sampling, max_tokens, stop strings and
EOS, eager and graph mode); requests admitted, aborted or preempted mid-run, grammar rows in the batch (sampled under
masks built after the in-flight step's commit) and a shared prefix end as they do synchronously, the pool whole
again. On CUDA (tests/engine/test_graphs.py) the same through captured graphs."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.engine.engine import Engine, EngineConfig
from tandem.engine.in_flight import resolve_async_scheduling
from tandem.llm import chat_prompt_ids
from tests.engine.test_paged_kv import _assert_pool_whole

EXAMPLES = generate_examples(6, seed=3, split="heldout")
MAX_LEN = 384
# Greedy and sampled rows, each finishing its own way: max_tokens (one at once), EOS, a stop string; two with
# penalties (built from the committed tokens once the in-flight step's are), one with logprobs.
PARAMS = [
    SamplingParams(max_tokens=5),
    SamplingParams(max_tokens=40, temperature=0.8, seed=5, frequency_penalty=0.8),
    SamplingParams(max_tokens=64, stop=[","], logprobs=3),
    SamplingParams(max_tokens=64, temperature=1.0, top_p=0.9, seed=7),
    SamplingParams(max_tokens=1),
    SamplingParams(max_tokens=48, repetition_penalty=1.3, logit_bias={11: 2.0}),
]


@pytest.fixture(autouse=True)
def _dynamo_only(monkeypatch):
    monkeypatch.setenv("TANDEM_COMPILE_BACKEND", "eager")


def _engine(models, name: str = "demo-llama", draft: str | None = None, **config) -> Engine:
    target, draft_model, tokenizer = models(name, draft)
    settings = dict(max_num_seqs=4, max_model_len=MAX_LEN, graph_mode="eager", block_size=4)
    return Engine(target, draft_model, tokenizer, EngineConfig(**{**settings, **config}))


def _prompts(engine: Engine) -> list[list[int]]:
    return [chat_prompt_ids(engine.tokenizer, e.messages, e.tools) for e in EXAMPLES]


def _run(
    engine: Engine,
    params: list[SamplingParams],
    *,
    late: int = 0,
    abort_after: dict[int, int] | None = None,
    examples: list[int] | None = None,
):
    """Each example's (token ids, finish reason, text) under ``params`` (``examples``: which, by index); the last
    ``late`` requests are added after three steps, and request ``i`` of ``abort_after`` is aborted after that many
    steps."""
    prompts, abort_after = _prompts(engine), abort_after or {}
    prompts = prompts if examples is None else [prompts[i] for i in examples]
    first = len(params) - late
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:first], params[:first])]
    steps = 0
    while engine.has_unfinished() or len(ids) < len(params):
        engine.step()
        steps += 1
        if steps == 3:
            ids += [engine.add_request(p, sp) for p, sp in zip(prompts[first:], params[first:])]
        for i, after in abort_after.items():
            if steps == after:
                engine.abort(ids[i])
    outputs = [engine.pop_finished(i) for i in ids]
    return [(o.token_ids, o.finish_reason, o.text, _Logprobs(o.logprobs)) for o in outputs]


class _Logprobs:
    """A request's logprobs, equal to another's when the tokens are and the values agree to 1e-5: the async step takes
    a log-softmax of the whole batch's logits where the synchronous one takes each row's, which may round
    differently in the last bits (float32)."""

    def __init__(self, logprobs) -> None:
        self.logprobs = logprobs

    def __eq__(self, other) -> bool:
        if self.logprobs is None or other.logprobs is None:
            return self.logprobs is other.logprobs
        return len(self.logprobs) == len(other.logprobs) and all(
            a.token_id == b.token_id
            and [t for t, _ in a.top] == [t for t, _ in b.top]
            and all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(_values(a), _values(b)))
            for a, b in zip(self.logprobs, other.logprobs)
        )

    def __len__(self) -> int:
        return len(self.logprobs)


def _values(logprob) -> list[float]:
    return [logprob.logprob, *(value for _, value in logprob.top)]


@pytest.mark.parametrize(
    "name, graph_mode", [("demo-llama", "eager"), ("demo-llama", "compiled"), ("demo-deepseek", "eager")]
)  # demo-deepseek's graphs: tests/engine/test_graphs.py's GPU test
def test_async_scheduling_gives_the_synchronous_outputs(models, name, graph_mode):
    """Four rows at a time of six: the last two admitted after three steps, and one aborted mid-run (its tokens
    a prefix of the synchronous run's: a step's tokens reach the host one step later, so an abort after as many
    steps may come before some of them)."""
    outputs = {}
    for overlap in (False, True):
        engine = _engine(models, name, graph_mode=graph_mode, async_scheduling=overlap)
        outputs[overlap] = _run(engine, PARAMS, late=2, abort_after={3: 12})
        assert (engine.overlapped_steps > 20) == overlap
        _assert_pool_whole(engine)
    assert [o for i, o in enumerate(outputs[True]) if i != 3] == [o for i, o in enumerate(outputs[False]) if i != 3]
    (aborted, reason, *_), (expected, *_) = outputs[True][3], outputs[False][3]
    assert reason == "abort" and 0 < len(aborted) <= len(expected) and expected[: len(aborted)] == aborted
    assert {reason for _, reason, *_ in outputs[True]} == {"length", "stop", "abort"}
    assert len(outputs[True][2][3]) == len(outputs[True][2][0]) > 0  # a logprob per token


def test_requests_queued_behind_taken_slots_keep_the_steps_overlapped(models):
    """One slot, three requests: while the others wait for it, the running row's steps launch ahead all the same.
    A row's prefill emits its first token and a step launched ahead each later one, none past max_tokens."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 30, 25)]
    outputs = {}
    for overlap in (False, True):
        engine = _engine(models, max_num_seqs=1, async_scheduling=overlap)
        outputs[overlap] = _run(engine, params)
    assert outputs[True] == outputs[False]
    assert engine.overlapped_steps == sum(p.max_tokens - 1 for p in params)


def test_a_pool_too_small_preempts_with_the_synchronous_outputs(models):
    """Blocks for one row of 256 positions among three rows of 96, 47 and 32 prompt tokens that each grow by 100:
    rows are preempted (async scheduling reads its in-flight step first: every row's next block must fit before a
    step launches ahead)."""
    roomy = _engine(models, max_model_len=256)
    memory = roomy.target_cache.bytes_per_position * 256
    params, examples = [SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.7, seed=3)] * 3, [2, 4, 5]
    outputs = {}
    for overlap in (False, True):
        engine = _engine(models, max_model_len=256, kv_cache_memory=memory, async_scheduling=overlap)
        outputs[overlap] = _run(engine, params, examples=examples)
        assert engine.kv_stats().preemptions > 0 and (engine.overlapped_steps > 0) == overlap
        _assert_pool_whole(engine)
    assert outputs[True] == outputs[False] == _run(roomy, params, examples=examples)


@pytest.mark.parametrize("name", ["demo-llama", "demo-deepseek"])
def test_grammar_rows_sample_under_the_mask_their_committed_token_left(models, name):
    """JSON-schema rows beside free ones: a step's forward launches ahead, and its sampling waits for the masks built
    after the in-flight step's commit (a grammar that terminates finishes its row there, its next sample dropped).
    Every answer as the synchronous engine's; each schema answer that stopped is valid."""
    schemas = [TASK_FAMILIES[e.family].schema for e in EXAMPLES]
    params = [SamplingParams(max_tokens=64, json_schema=schemas[i]) for i in (0, 1, 4)] + PARAMS[2:4]
    outputs = {}
    for overlap in (False, True):
        engine = _engine(models, name, async_scheduling=overlap, max_num_seqs=3)
        outputs[overlap] = _run(engine, params, examples=[0, 1, 4, 2, 3])
        assert (engine.overlapped_steps > 40) == overlap
    assert outputs[True] == outputs[False]
    for (_, reason, text, _), schema in zip(outputs[True][:3], (schemas[i] for i in (0, 1, 4))):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_a_shared_prefix_reuses_the_blocks_it_registered(models):
    """Blocks registered while a step is in flight hold committed tokens only: a second turn that shares the
    first's prompt and answer reuses them and outputs what it outputs synchronously."""
    outputs, cached = {}, {}
    for overlap in (False, True):
        engine = _engine(models, async_scheduling=overlap)
        prompt = _prompts(engine)[0]
        first = engine.add_request(prompt, SamplingParams(max_tokens=24))
        while engine.has_unfinished():
            engine.step()
        answer = engine.pop_finished(first).token_ids
        second = engine.add_request(prompt + answer + [418, 416], SamplingParams(max_tokens=24))
        while engine.has_unfinished():
            engine.step()
        output = engine.pop_finished(second)
        outputs[overlap], cached[overlap] = (answer, output.token_ids), output.num_cached_tokens
    assert outputs[True] == outputs[False] and cached[True] == cached[False] >= len(prompt) - 4


def test_async_scheduling_with_a_draft_is_refused(models):
    with pytest.raises(ValueError, match="async_scheduling overlaps plain decode steps"):
        _engine(models, draft="eagle3", async_scheduling=True)


@pytest.mark.parametrize(
    "device, graph_mode, draft, parallel, expected",
    [
        ("cuda", "compiled", None, False, True),
        ("cuda", "eager", None, False, False),  # eager CUDA steps are bound by the host either way
        ("cpu", "compiled", None, False, False),  # a CPU forward runs on the host itself
        ("cuda", "compiled", object(), False, False),  # a draft's proposal reads the committed tokens
        ("cuda", "compiled", None, True, False),
    ],
)
def test_auto_async_scheduling_is_on_for_plain_cuda_graphs_only(device, graph_mode, draft, parallel, expected):
    """None ("auto") turns async scheduling on where it was measured to pay; an explicit choice stands (or is
    refused, as above)."""
    assert resolve_async_scheduling(None, torch.device(device), graph_mode, draft=draft, parallel=parallel) is expected
    assert resolve_async_scheduling(False, torch.device(device), graph_mode, draft=None, parallel=False) is False
    with pytest.raises(ValueError, match="parallel ranks"):
        resolve_async_scheduling(True, torch.device("cuda"), "compiled", draft=None, parallel=True)


def test_auto_async_scheduling_leaves_a_cpu_engine_synchronous(models):
    engine = _engine(models)
    assert engine.config.async_scheduling is None and not engine.async_scheduling
