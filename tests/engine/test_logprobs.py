"""Log-probabilities of generated tokens: the target model's own (raw logits, teacher-forced
transformers as the reference), the same through the speculative path, one per token."""

import pytest
import torch
from transformers import LlamaForCausalLM

from tandem.decoding.params import SamplingParams
from tandem.engine import Engine, EngineConfig

from .test_engine import PROMPTS, run

TOP = 5


def _reference_log_probs(reference, tokenizer, prompt: str, generated: list[int]) -> torch.Tensor:
    """[n, V] transformers' log-softmax at the positions that emitted `generated`."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        logits = reference(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
    return logits.float().log_softmax(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, logprobs=TOP),
        SamplingParams(max_tokens=20, logprobs=TOP, temperature=1.0, top_k=8, seed=3),
    ],
)
def test_logprobs_are_the_raw_ones_of_the_target_model(llama_dirs, llama_target, tokenizer, params):
    reference = LlamaForCausalLM.from_pretrained(llama_dirs["target"]).eval()
    for prompt, output in zip(PROMPTS[:3], run(llama_target, None, tokenizer, PROMPTS[:3], params)):
        expected = _reference_log_probs(reference, tokenizer, prompt, output.token_ids)
        assert [entry.token_id for entry in output.logprobs] == output.token_ids
        got = torch.tensor([entry.logprob for entry in output.logprobs])
        torch.testing.assert_close(
            got, expected.gather(-1, torch.tensor(output.token_ids)[:, None])[:, 0], atol=1e-4, rtol=0
        )
        top_values, _ = expected.topk(TOP, dim=-1)
        for entry, values in zip(output.logprobs, top_values):
            assert len(entry.top) == TOP and [v for _, v in entry.top] == sorted(
                (v for _, v in entry.top), reverse=True
            )
            torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), values, atol=1e-4, rtol=0)
            assert all(expected.shape[-1] > token >= 0 for token, _ in entry.top)
        if params.temperature == 0:  # greedy: the emitted token is the most likely one
            assert all(entry.top[0] == (entry.token_id, entry.logprob) for entry in output.logprobs)


def test_speculative_logprobs_equal_plain_ones(llama_target, llama_drafts, tokenizer):
    """Accepted drafts read theirs from the verify pass (the trained demo pairs: test_demo_pairs)."""
    params = SamplingParams(max_tokens=32, logprobs=2)
    plain = run(llama_target, None, tokenizer, PROMPTS, params)
    spec = run(llama_target, llama_drafts["ngram"], tokenizer, PROMPTS, params)
    assert sum(o.stats.accepted for o in spec) > 0
    assert_same_logprobs(spec, plain)


def assert_same_logprobs(outputs, expected) -> None:
    """Same tokens, and log-probabilities equal up to float rounding."""
    for got, want in zip(outputs, expected, strict=True):
        assert got.token_ids == want.token_ids
        values = lambda out: torch.tensor([[e.logprob, *(v for _, v in e.top)] for e in out.logprobs])  # noqa: E731
        torch.testing.assert_close(values(got), values(want), atol=1e-4, rtol=0)


def test_one_logprob_per_token_through_stops_limits_and_streaming(llama_target, llama_drafts, tokenizer):
    engine = Engine(llama_target, llama_drafts["eagle3"], tokenizer, EngineConfig(max_model_len=160))
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:4]]
    free = SamplingParams(max_tokens=40, logprobs=0)
    text = run(llama_target, None, tokenizer, PROMPTS[2:3], free)[0].text
    assert len(text) > 8
    params = [
        free,
        SamplingParams(max_tokens=7, logprobs=1),
        SamplingParams(max_tokens=40, stop=[text[5:8]], logprobs=0),
        SamplingParams(max_tokens=40),
    ]
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    streamed = {i: [] for i in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            assert (delta.logprobs is None) == (delta.request_id == ids[3])
            assert delta.logprobs is None or len(delta.logprobs) == len(delta.token_ids)
            streamed[delta.request_id] += delta.logprobs or []
    outputs = [engine.pop_finished(i) for i in ids]
    assert outputs[1].finish_reason == "length" and outputs[2].finish_reason == "stop" and outputs[3].logprobs is None
    for request_id, output in zip(ids[:3], outputs):
        assert [e.token_id for e in output.logprobs] == output.token_ids and streamed[request_id] == output.logprobs
    assert all(e.top == [] for e in outputs[0].logprobs) and all(len(e.top) == 1 for e in outputs[1].logprobs)


def test_logprobs_are_checked():
    for bad in (-1, 21, 2.5):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
