"""Answers that close within max_tokens: a schema answer cut by its budget still validates (finish "length"),
speculative equals plain token for token with the closing masks, a large budget stops and validates, and a
budget too small for any answer ends by length."""

import json

import jsonschema
import pytest
import torch

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.llm import LLM

EXAMPLES = generate_examples(3, seed=23, split="heldout")
PAIRS = [("demo-llama", "eagle3"), ("demo-deepseek", "mtp")]


@pytest.fixture(scope="module")
def llms():
    cache: dict[tuple[str, str | None], LLM] = {}

    def get(model: str, draft: str | None) -> LLM:
        if (model, draft) not in cache:
            cache[model, draft] = LLM(model, draft, num_speculative_tokens=4, dtype=torch.float32, max_num_seqs=3)
        return cache[model, draft]

    return get


def generate(llm: LLM, budgets: list[int]) -> list:
    engine = llm.engine
    ids = [
        engine.add_request(
            llm.chat_prompt(e.messages, e.tools),
            SamplingParams(max_tokens=budget, json_schema=TASK_FAMILIES[e.family].schema),
        )
        for e, budget in zip(EXAMPLES, budgets)
    ]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


def valid(example, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), TASK_FAMILIES[example.family].schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def without_closing(monkeypatch, llm: LLM) -> None:
    monkeypatch.setattr(llm.engine.masker, "closer", None)
    monkeypatch.setattr(llm.engine.step_masks, "closing", False)


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_a_schema_answer_cut_by_max_tokens_still_validates(llms, pair, monkeypatch):
    model, draft = pair
    free = generate(llms(model, draft), [160] * len(EXAMPLES))
    assert all(o.finish_reason == "stop" and valid(e, o.text) for e, o in zip(EXAMPLES, free))
    budgets = [len(o.token_ids) - 6 for o in free]  # six tokens short of the answer the model writes
    closed = generate(llms(model, draft), budgets)
    plain = generate(llms(model, None), budgets)
    assert [o.token_ids for o in closed] == [o.token_ids for o in plain]
    for example, output, budget in zip(EXAMPLES, closed, budgets):
        assert output.finish_reason == "length" and len(output.token_ids) == budget
        assert valid(example, output.text), output.text
    with monkeypatch.context() as patch:
        without_closing(patch, llms(model, draft))
        cut = generate(llms(model, draft), budgets)
    assert not any(valid(e, o.text) for e, o in zip(EXAMPLES, cut))  # what the closing masks spared


def test_a_budget_too_small_for_any_answer_ends_by_length(llms):
    outputs = generate(llms("demo-llama", "eagle3"), [3] * len(EXAMPLES))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 3 for o in outputs)
