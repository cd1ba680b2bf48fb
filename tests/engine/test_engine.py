"""The engine end to end on a tiny random Llama: exactness, batching, seeds and stop rules."""

import pytest
import torch
from transformers import LlamaForCausalLM

from tandem.decoding.params import SamplingParams
from tandem.engine import Engine, EngineConfig, PromptTooLongError
from tandem.engine.engine import SMALL_STEP_TOKENS

from .conftest import LLAMA_DRAFTS

PROMPTS = [
    "hello world",
    "the weather in Paris is",
    "x",
    '{"name": "get_weather", "arguments": {"city": "',
    "1 2 3 1 2 3 1 2",
    "Book a table for two",
    "<think>\nok",
    "convert 5 km",
]


def run(target, draft, tokenizer, prompts, params, *, k=4, max_num_seqs=8, max_model_len=160, adaptive=True):
    """Generate with a fresh engine; params may be one SamplingParams or one per prompt."""
    engine = Engine(
        target,
        draft,
        tokenizer,
        EngineConfig(
            num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_model_len=max_model_len, adaptive=adaptive
        ),
    )
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(tokenizer.encode(p, add_special_tokens=False), q) for p, q in zip(prompts, per_prompt)]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


def test_plain_greedy_equals_transformers_generate(llama_dirs, llama_target, tokenizer):
    reference = LlamaForCausalLM.from_pretrained(llama_dirs["target"]).eval()
    outputs = run(llama_target, None, tokenizer, PROMPTS[:3], SamplingParams(max_tokens=24))
    for prompt, output in zip(PROMPTS[:3], outputs):
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        expected = reference.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert output.token_ids == expected[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("draft", LLAMA_DRAFTS)
@pytest.mark.parametrize("batch", [1, 8])
def test_speculative_greedy_equals_plain_greedy_token_for_token(llama_target, llama_drafts, tokenizer, draft, batch):
    params = SamplingParams(max_tokens=32)
    plain = run(llama_target, None, tokenizer, PROMPTS[:batch], params)
    # An n-gram draft that mostly has no proposal is rarely asked by adaptive speculation, which may leave it
    # nothing to verify in 32 tokens: at a fixed k its proposals are verified (adaptive's exactness has its own tests).
    spec = run(llama_target, llama_drafts[draft], tokenizer, PROMPTS[:batch], params, adaptive=draft != "ngram")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats.drafted for o in spec) > 0


@pytest.mark.parametrize("schema", [False, True], ids=["free", "schema"])
def test_a_chained_proposal_stays_on_the_device_unless_a_walk_reads_it(llama_target, llama_drafts, tokenizer, schema):
    """Free rows' drafts are never read back: the next verify takes their values from the proposal tensor
    (`Request.drafts_on_device`; `drafts` holds placeholders) and decodes plain greedy's tokens. A grammar row's walk
    reads its drafts: they are on the host."""
    params = SamplingParams(max_tokens=24, json_schema={"type": "object"} if schema else None)
    engine = Engine(llama_target, llama_drafts["eagle3"], tokenizer, EngineConfig(max_num_seqs=4, adaptive=False))
    ids = [engine.add_request(tokenizer.encode(p, add_special_tokens=False), params) for p in PROMPTS[:4]]
    placed = []
    while engine.has_unfinished():
        engine.step()
        placed += [r.drafts_on_device is not None for r in engine.scheduler.running if r.drafts]
    assert placed and all(placed) != schema and any(placed) != schema
    outputs = [engine.pop_finished(i).token_ids for i in ids]
    assert outputs == [o.token_ids for o in run(llama_target, None, tokenizer, PROMPTS[:4], params)]


def test_ngram_drafts_are_accepted_on_repetitive_text(llama_target, llama_drafts, tokenizer):
    # The tiny random model loops quickly: prompt lookup must then get whole runs accepted. A property of
    # the draft at a fixed k: adaptive speculation, which may verify fewer where a verify costs more than
    # it saves on this tiny model, is off.
    outputs = run(
        llama_target, llama_drafts["ngram"], tokenizer, PROMPTS, SamplingParams(max_tokens=48), adaptive=False
    )
    assert sum(o.stats.accepted for o in outputs) > 20
    assert max(o.stats.mean_accepted_length for o in outputs) > 1.5


@pytest.mark.parametrize(
    "adjust",
    [{}, {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {7: 2.0}}],
    ids=["plain", "penalties"],
)
@pytest.mark.parametrize("draft", [None, "ngram"])
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(
    llama_target, llama_drafts, tokenizer, draft, adjust
):
    model = None if draft is None else llama_drafts[draft]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, **adjust)
    alone = run(llama_target, model, tokenizer, PROMPTS[1:2], params)[0]
    again = run(llama_target, model, tokenizer, PROMPTS[1:2], params)[0]
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=10 + s) for s in range(7)]
    crowded = run(
        llama_target, model, tokenizer, PROMPTS[:1] + PROMPTS[1:2] + PROMPTS[2:8], [others[0], params, *others[1:]]
    )[1]
    assert alone.token_ids == again.token_ids == crowded.token_ids
    different = run(
        llama_target,
        model,
        tokenizer,
        PROMPTS[1:2],
        SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24),
    )[0]
    assert different.token_ids != alone.token_ids


def test_continuous_batching_gives_each_request_what_it_gets_alone(llama_target, llama_drafts, tokenizer):
    """More requests than slots, different lengths and settings: rows join and leave between steps."""
    params = [
        SamplingParams(max_tokens=5 + 7 * i, temperature=0.0 if i % 2 else 0.8, seed=i, top_k=20 * (i % 3))
        for i in range(len(PROMPTS))
    ]
    together = run(llama_target, llama_drafts["ngram"], tokenizer, PROMPTS, params, max_num_seqs=3)
    for prompt, p, output in zip(PROMPTS, params, together):
        alone = run(llama_target, llama_drafts["ngram"], tokenizer, [prompt], p, max_num_seqs=1)[0]
        assert output.token_ids == alone.token_ids


@pytest.mark.parametrize("draft", [None, *LLAMA_DRAFTS])
def test_max_tokens_is_never_exceeded_even_by_an_accepted_draft_run(llama_target, llama_drafts, tokenizer, draft):
    model = None if draft is None else llama_drafts[draft]
    for max_tokens in (1, 2, 3, 7):
        outputs = run(llama_target, model, tokenizer, PROMPTS[3:5], SamplingParams(max_tokens=max_tokens))
        assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in outputs)


def test_stop_string_ends_the_answer_before_it_and_frees_the_row(llama_target, llama_drafts, tokenizer):
    free = run(llama_target, llama_drafts["ngram"], tokenizer, PROMPTS[4:5], SamplingParams(max_tokens=30))[0]
    stop = free.text[5:8]  # a string the model is known to produce
    stopped = run(
        llama_target, llama_drafts["ngram"], tokenizer, PROMPTS[4:5], SamplingParams(max_tokens=30, stop=[stop])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert len(stopped.token_ids) <= len(free.token_ids)


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_a_stop_token_ends_the_request_like_eos(llama_target, llama_drafts, tokenizer, draft):
    model = None if draft is None else llama_drafts[draft]
    free = run(llama_target, model, tokenizer, PROMPTS[4:5], SamplingParams(max_tokens=16))[0]
    stop_token = free.token_ids[6]
    stopped = run(
        llama_target, model, tokenizer, PROMPTS[4:5], SamplingParams(max_tokens=16, stop_token_ids=[stop_token])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]


def test_a_prompt_longer_than_the_context_is_refused_and_the_engine_goes_on(llama_target, tokenizer):
    engine = Engine(llama_target, None, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=32))
    with pytest.raises(PromptTooLongError, match="prompt has 40 tokens; the context is 32 tokens"):
        engine.add_request(list(range(40)), SamplingParams())
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_finished(request).token_ids) == 4


def test_token_ids_outside_the_vocabulary_are_refused_and_the_engine_goes_on(llama_target, tokenizer):
    engine = Engine(llama_target, None, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=32))
    vocab_size = llama_target.vocab_size
    with pytest.raises(ValueError, match=f"prompt: token id {vocab_size} is outside the vocabulary"):
        engine.add_request([1, vocab_size, 3], SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams.logit_bias: token id"):
        engine.add_request([1, 2], SamplingParams(logit_bias={vocab_size + 5: 1.0}))
    forced = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, logit_bias={11: 100.0}))
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_finished(forced).token_ids == [11] * 4


@pytest.mark.parametrize("small_step_threads", [1, None])
def test_steps_of_few_tokens_run_on_the_small_step_threads(llama_target, tokenizer, monkeypatch, small_step_threads):
    seen = []  # (tokens, torch threads) of every target forward
    forward = llama_target.forward

    def recording_forward(batch, *args, **kwargs):
        seen.append((batch.num_tokens, torch.get_num_threads()))
        return forward(batch, *args, **kwargs)

    monkeypatch.setattr(llama_target, "forward", recording_forward)
    engine = Engine(
        llama_target, None, tokenizer, EngineConfig(max_model_len=64, small_step_threads=small_step_threads)
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.add_request(list(range(10, 10 + SMALL_STEP_TOKENS + 1)), SamplingParams(max_tokens=3))
        while engine.has_unfinished():
            engine.step()
            assert torch.get_num_threads() == 2  # restored after every step
    finally:
        torch.set_num_threads(previous)
    small = 2 if small_step_threads is None else small_step_threads
    assert seen == [(SMALL_STEP_TOKENS + 1, 2), (1, small), (1, small)]
