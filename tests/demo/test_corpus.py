"""The demo corpus: deterministic per seed, every answer valid for its family's schema."""

import json

import jsonschema
import pytest

from tandem.demo.corpus import TASK_FAMILIES, TOOLS, Pools, generate_examples, iter_examples


def test_same_seed_gives_same_examples_and_other_seed_differs():
    assert generate_examples(50, seed=3) == generate_examples(50, seed=3)
    assert generate_examples(50, seed=3) != generate_examples(50, seed=4)


def test_every_answer_validates_against_its_family_schema():
    examples = generate_examples(600, seed=0) + generate_examples(200, seed=0, split="heldout")
    assert {example.family for example in examples} == set(TASK_FAMILIES)
    for example in examples:
        schema = TASK_FAMILIES[example.family].schema
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(json.loads(example.answer_text), schema, cls=jsonschema.Draft202012Validator)


def test_schemas_reject_answers_of_other_families():
    by_family = {example.family: example.answer for example in generate_examples(300, seed=1)}
    for name, family in TASK_FAMILIES.items():
        validator = jsonschema.Draft202012Validator(family.schema)
        for other, answer in by_family.items():
            assert validator.is_valid(answer) == (other == name), (name, other)


def test_tool_calls_use_name_arguments_format_and_offer_their_tool():
    for example in generate_examples(300, seed=2):
        family = TASK_FAMILIES[example.family]
        if family.tool is None:
            assert example.tools is None
            continue
        assert set(example.answer) == {"name", "arguments"}
        assert example.answer["name"] == family.tool["function"]["name"]
        assert family.tool in example.tools and all(tool in TOOLS for tool in example.tools)
        assert len({tool["function"]["name"] for tool in example.tools}) == len(example.tools)


def test_reasoning_mentions_the_values_it_answers_with():
    for example in generate_examples(300, seed=5):
        answer = example.answer.get("arguments", example.answer)
        mentioned = [v for v in answer.values() if isinstance(v, (str, int, float)) and str(v) in example.reasoning]
        assert mentioned, example


def test_heldout_values_never_appear_in_training_pools():
    train, heldout = Pools("train").items, Pools("heldout").items
    for key in train:
        assert heldout[key] and not set(train[key]) & set(heldout[key]), key
    cities = set(heldout["city"])
    train_contacts = [e for e in generate_examples(500, seed=0) if e.family == "contact"]
    assert train_contacts and all(e.answer["city"] not in cities for e in train_contacts)


def test_families_filter_and_unknown_family_error():
    stream = iter_examples(0, families=["weather", "ticket"])
    assert {next(stream).family for _ in range(40)} == {"weather", "ticket"}
    with pytest.raises(ValueError, match="unknown task families.*nope"):
        next(iter_examples(0, families=["nope"]))
