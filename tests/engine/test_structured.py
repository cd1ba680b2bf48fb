"""Constrained generation end to end on the shipped demo Llama: every answer validates, the
grammar starts after `</think>`, and speculation changes nothing under a schema."""

import json

import jsonschema
import pytest

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.engine import masks as engine_masks
from tandem.llm import LLM

EXAMPLES = generate_examples(6, seed=7, split="heldout")


@pytest.fixture(scope="module")
def plain():
    return LLM("demo-llama", None, max_num_seqs=6)


@pytest.fixture(scope="module")
def speculative():
    return LLM("demo-llama", "ngram", max_num_seqs=6)


def _generate(llm, params_for):
    engine = llm.engine
    ids = []
    for example in EXAMPLES:
        ids.append(engine.add_request(llm.chat_prompt(example.messages, example.tools), params_for(example)))
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


def _schema_params(example, **extra):
    return SamplingParams(max_tokens=160, json_schema=TASK_FAMILIES[example.family].schema, **extra)


@pytest.mark.parametrize("llm_name", ["plain", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_finished_constrained_answer_validates_against_its_schema(request, llm_name, temperature):
    llm = request.getfixturevalue(llm_name)
    outputs = _generate(llm, lambda ex: _schema_params(ex, temperature=temperature, seed=5))
    finished = 0
    for example, output in zip(EXAMPLES, outputs):
        assert output.finish_reason in ("stop", "length"), output.error
        if output.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(output.text), TASK_FAMILIES[example.family].schema)
            assert "</think>" not in output.text and "<think>" not in output.reasoning
    assert finished >= len(EXAMPLES) // 2


def test_speculative_equals_plain_under_a_schema(plain, speculative, monkeypatch):
    expected = _generate(plain, _schema_params)
    got = _generate(speculative, _schema_params)  # n-gram proposals walked for grammar-forced drafts
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert sum(o.stats.accepted for o in got) > 0
    # Without forced drafts the n-gram draft copies its tokens, so the engine must not walk the grammar
    # for it: the masks come from the pipeline.
    monkeypatch.setattr(speculative.engine, "forced_drafts", False)
    monkeypatch.setattr(engine_masks, "MaskWalk", None)
    got = _generate(speculative, _schema_params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_an_invalid_schema_is_refused_before_anything_runs_and_the_engine_goes_on(plain):
    with pytest.raises(ValueError, match="/properties/n"):
        plain.generate(["hi"], SamplingParams(json_schema={"type": "object", "properties": {"n": {"type": "nope"}}}))
    assert plain.generate(["hi"], SamplingParams(max_tokens=3))[0].finish_reason == "length"


def test_choice_constrains_the_answer_after_thinking(plain):
    out = plain.chat(
        [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        SamplingParams(max_tokens=120, choice=["yes", "no"]),
    )
    if out.finish_reason == "stop":
        assert out.text in ("yes", "no")
    assert out.finish_reason in ("stop", "length")
