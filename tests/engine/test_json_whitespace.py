"""Issue 30: a JSON-schema answer on demo-llama + EAGLE-3 never closed: after a few array items the
model wrote spaces until max_tokens, as the grammar allowed any whitespace between JSON tokens.
Requests now get json.dumps's separators by default (SamplingParams.json_whitespace)."""

import json
import random
import re

import jsonschema
import pytest
import torch

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import SYSTEM_PROMPT, Pools
from tandem.engine.request import grammar_spec
from tandem.llm import LLM
from tandem.serve.protocol import ChatCompletionRequest, Constraint

TRIP_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "packing": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
    },
    "required": ["city", "days", "packing"],
}
_RNG = random.Random(30)
_CITIES = Pools("heldout").items["city"]
PROMPTS = [  # held-out cities, trip requests the corpus never asks
    [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Plan a {days}-day trip to {city}: the city, the days and what to pack."},
    ]
    for city, days in zip(_RNG.sample(_CITIES, 6), (2, 3, 4, 5, 6, 7))
]
MAX_TOKENS = 200  # reasoning plus answer; the runaway ran to this limit


@pytest.fixture(scope="module")
def llm():
    return LLM("demo-llama", "eagle3", num_speculative_tokens=4, dtype=torch.float32, max_num_seqs=len(PROMPTS))


def _generate(llm, prompts=PROMPTS, **fields):
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, json_schema=TRIP_SCHEMA, **fields)
    ids = [engine.add_request(llm.chat_prompt(messages), params) for messages in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


def test_default_answers_never_run_whitespace_and_finished_ones_validate(llm):
    outputs = _generate(llm)  # greedy, json_whitespace="default"
    for output in outputs:
        assert output.finish_reason in ("stop", "length"), output.error
        assert not re.search(r"\s\s", output.text), output.text
        if output.finish_reason == "stop":
            jsonschema.validate(json.loads(output.text), TRIP_SCHEMA)
    assert sum(o.finish_reason == "stop" for o in outputs) >= len(outputs) // 2


def test_compact_answers_have_no_whitespace_outside_strings(llm):
    for output in _generate(llm, PROMPTS[:3], json_whitespace="compact"):
        if output.finish_reason == "stop":
            jsonschema.validate(answer := json.loads(output.text), TRIP_SCHEMA)
            assert output.text == json.dumps(answer, ensure_ascii=False, separators=(",", ":"))


def test_the_option_reaches_the_grammar_spec_and_is_validated():
    assert grammar_spec(SamplingParams(json_schema=TRIP_SCHEMA)).whitespace == "default"
    assert grammar_spec(SamplingParams(json_schema=TRIP_SCHEMA, json_whitespace=2)).whitespace == 2
    assert grammar_spec(SamplingParams(json_schema=TRIP_SCHEMA, json_whitespace=0)).whitespace == "compact"
    for bad in ("pretty", -1, 65, True, 2.5):
        with pytest.raises(ValueError, match="json_whitespace.*'default'.*'compact'.*0..64"):
            SamplingParams(json_whitespace=bad)


def test_the_server_request_field_defaults_to_json_dumps_separators():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    schema = Constraint("json_schema", TRIP_SCHEMA, "response_format")
    assert ChatCompletionRequest(**body).sampling_params(8, schema)[0].json_whitespace == "default"
    (params,) = ChatCompletionRequest(**body, json_whitespace="compact").sampling_params(8, schema)
    assert params.json_whitespace == "compact"
    assert ChatCompletionRequest(**body, json_whitespace=3).json_whitespace == 3
    for bad in ("pretty", 65, True):
        with pytest.raises(ValueError):
            ChatCompletionRequest(**body, json_whitespace=bad)
