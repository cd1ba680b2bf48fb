"""The Python API (`tandem.LLM`) on the shipped demo Llama: generate, chat, stream, relaxed acceptance."""

import json

import jsonschema
import pytest
import torch
from pydantic import BaseModel

from tandem import LLM, RelaxedAcceptance, SamplingParams, cli
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.llm import resolve_device, resolve_model

EXAMPLES = generate_examples(4, seed=21, split="heldout")


class Sentiment(BaseModel):
    label: str
    confidence: float


@pytest.fixture(scope="module")
def llm():
    return LLM("demo-llama", "eagle3", num_speculative_tokens=4)


def test_generate_takes_text_token_ids_or_a_list_and_keeps_prompt_order(llm):
    params = SamplingParams(max_tokens=12)
    ids = [llm.chat_prompt(ex.messages, ex.tools) for ex in EXAMPLES]
    together = llm.generate(ids, params)
    assert [o.prompt_token_ids for o in together] == ids
    assert llm.generate(ids[2], params)[0].token_ids == together[2].token_ids
    text = llm.tokenizer.decode(ids[1])
    assert llm.generate(text, params)[0].token_ids == together[1].token_ids


@pytest.mark.parametrize("one_token_steps", [False, True], ids=["speculative", "one-token-steps"])
def test_stream_deltas_add_up_to_the_generated_output(llm, one_token_steps, monkeypatch):
    """Text, reasoning and token ids; with one token a step (no row drafts), a token that shows no text yet (a
    thinking marker, part of a character) comes in a delta of its own, with its id and no text."""
    if one_token_steps:
        monkeypatch.setattr(llm.engine.policy, "choose", lambda ids, pinned=None: [0] * len(ids))
    prompt, params = llm.chat_prompt(EXAMPLES[0].messages), SamplingParams(max_tokens=64)
    deltas = list(llm.stream(prompt, params))
    expected = llm.generate([prompt], params)[0]
    assert "".join(d.reasoning for d in deltas) == expected.reasoning
    assert "".join(d.text for d in deltas) == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert deltas[-1].finish_reason == expected.finish_reason and all(d.finish_reason is None for d in deltas[:-1])
    assert len(deltas) > 2, "streamed in one piece"
    if one_token_steps:
        assert any(d.token_ids and not d.has_content for d in deltas)


def test_chat_with_a_pydantic_response_format_returns_a_valid_answer(llm):
    out = llm.chat(
        [{"role": "user", "content": "Classify the sentiment of this review: I was delighted with the kettle."}],
        SamplingParams(max_tokens=96),
        response_format=Sentiment,
    )
    assert out.finish_reason == "stop", out
    Sentiment.model_validate_json(out.text)
    assert out.reasoning and "</think>" not in out.text


@pytest.fixture(scope="module")
def relaxed_llm():
    return LLM("demo-llama", "eagle3", num_speculative_tokens=4, relaxed=RelaxedAcceptance(top_k=10, delta=0.6))


def test_relaxed_acceptance_keeps_the_answer_schema_valid(relaxed_llm):
    for example in EXAMPLES:
        schema = TASK_FAMILIES[example.family].schema
        out = relaxed_llm.generate(
            [relaxed_llm.chat_prompt(example.messages, example.tools)],
            SamplingParams(max_tokens=128, json_schema=schema),
        )[0]
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)


def test_relaxed_acceptance_changes_nothing_after_the_reasoning(llm, relaxed_llm):
    """Prompts that already closed `</think>`: every position is answer, so relaxed == exact greedy."""
    close = llm.tokenizer.convert_tokens_to_ids("</think>")
    params = SamplingParams(max_tokens=48)
    prompts = [llm.chat_prompt(ex.messages, ex.tools) + llm.encode(ex.reasoning + "\n") + [close] for ex in EXAMPLES]
    exact = llm.generate(prompts, params)
    relaxed = relaxed_llm.generate(prompts, params)
    assert [o.token_ids for o in relaxed] == [o.token_ids for o in exact]
    assert all(o.reasoning == "" and o.text for o in relaxed)


def test_unknown_model_or_draft_names_what_is_available():
    with pytest.raises(FileNotFoundError, match="shipped models: .*demo-llama"):
        LLM("no-such-model")
    with pytest.raises(FileNotFoundError, match="draft 'eagle'"):
        LLM("demo-deepseek", "eagle")


def test_cli_generate_runs_the_demo_model_with_its_best_draft_and_a_schema(tmp_path, capsys):
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["label"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    assert cli.main(["generate", "--json", "--max-tokens", "96", "--schema", str(tmp_path / "schema.json")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["model"], out["draft"]) == ("demo-deepseek", "mtp")
    assert out["finish_reason"] == "stop" and out["reasoning"]
    jsonschema.validate(json.loads(out["text"]), schema)
    assert out["stats"]["mean_accepted_length"] > 1


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--schema", "{bad}"], "--schema {bad}: not JSON (Expecting property name"),
        (["--schema", "{typo}"], "json_schema at /properties/a/type: 'strin' is not valid"),
        (["--schema", "missing.json"], "--schema missing.json: No such file or directory"),
        (["--model", "nowhere"], "model 'nowhere': no config.json"),
        (["--draft", "medusa"], "draft 'medusa': not a kind"),
        (["-k", "0"], "num_speculative_tokens = 0 with a draft: a draft proposes at least 1 token"),
    ],
)
def test_cli_reports_bad_input_in_one_line_without_a_traceback(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "{bad}").write_text("{not json")
    (tmp_path / "{typo}").write_text(json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}}))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "hi", "--max-tokens", "4", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("tandem generate: error: ") and says in err
    assert "Traceback" not in err


def test_auto_device_is_cuda_exactly_when_there_is_a_gpu():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"


def test_bench_runs_the_transformers_peer_on_tandems_device_and_dtype():
    from tandem.cli.bench import _transformers_model

    model = _transformers_model(resolve_model("demo-llama"), torch.device("cpu"), torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.bfloat16)}


def test_bench_ratios_are_medians_of_ratios_within_a_round():
    """The machine slows down between rounds (1x, 2x, 1.5x). Within a round the speculative path
    is twice as fast as the plain one, except that a burst of load hit its turn in round 1. The
    median of the within-round ratios says 2.0; the cases' fastest rounds alone would say 1.667.
    Each batch gets its own ratios: at batch 8 speculation is 1.5x plain, and under the schema 1.2x
    (constrained 0.8x its unconstrained speed, plain under the schema as fast as without)."""
    from tandem.cli.bench import _ratios

    slowdown = [1.0, 2.0, 1.5]

    def runs(factor: float, bursts=(1, 1, 1)) -> list[dict]:  # `factor` times plain batch 1's speed
        return [
            {"generated": 100, "seconds": s / factor * burst, "first_token_seconds": s / factor / 10, "requests": 1}
            for s, burst in zip(slowdown, bursts)
        ]

    rounds = {
        ("none", 0, False, False, 1, "eager"): runs(1),
        ("eagle", 4, False, False, 1, "eager"): runs(2, (1.2, 1, 1)),
        ("none", 0, False, False, 8, "eager"): runs(4),
        ("none", 0, False, True, 8, "eager"): runs(4),
        ("eagle", 4, False, False, 8, "eager"): runs(6),
        ("eagle", 4, False, True, 8, "eager"): runs(4.8),
        ("transformers", "plain"): [{"generated": 50, "seconds": s} for s in slowdown],
    }
    ratios, ratio_range = _ratios(rounds, k=4, batches=[1, 8], mode="eager")
    assert ratios == {
        "tandem_plain_vs_transformers_plain": 2.0,
        "eagle_k4_batch1_vs_plain": 2.0,
        "eagle_k4_batch1_decode_vs_plain": 2.0,
        "eagle_k4_batch8_vs_plain": 1.5,
        "eagle_k4_batch8_decode_vs_plain": 1.5,
        "eagle_k4_batch8_schema_vs_unconstrained": 0.8,
        "eagle_k4_batch8_schema_vs_plain": 1.2,
    }
    assert ratio_range["tandem_plain_vs_transformers_plain"] == [2.0, 2.0]
    assert ratio_range["eagle_k4_batch1_vs_plain"] == [1.667, 2.0]
    assert ratio_range["eagle_k4_batch1_decode_vs_plain"] == [1.636, 2.0]
    assert ratio_range["eagle_k4_batch8_schema_vs_plain"] == [1.2, 1.2]


def test_bench_decode_rate_leaves_out_each_requests_first_token_and_the_time_to_it():
    """Two requests; 1 s until both had their first token, 21 tokens in all: the other 19 took 2 s."""
    from tandem.cli.bench import _fastest

    run = {"seconds": 3.0, "first_token_seconds": 1.0, "requests": 2, "generated": 21, "steps": 10, "accepted": 11}
    row = _fastest([run, {**run, "seconds": 4.0}])
    assert (row["tokens_per_s"], row["decode_tokens_per_s"], row["mean_accepted_length"]) == (7.0, 9.5, 2.1)
