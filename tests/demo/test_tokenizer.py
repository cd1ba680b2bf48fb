"""The shipped demo tokenizer: HF-loadable, lossless, single-id specials, R1-style chat template."""

import json

import pytest
from transformers import AutoTokenizer

from tandem.assets import TOKENIZER_DIR
from tandem.demo.corpus import generate_examples
from tandem.demo.tokenizer import SPECIAL_TOKENS, THINK_CLOSE, THINK_OPEN, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_special_tokens_are_single_ids_in_order(tokenizer):
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert tokenizer.eos_token == "<|eot_id|>" and tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.encode("x", add_special_tokens=True)[0] == tokenizer.bos_token_id


def test_think_markers_in_text_encode_to_their_ids(tokenizer):
    ids = tokenizer.encode('plan it<think>a\n</think>{"a": 1}', add_special_tokens=False)
    opening, closing = tokenizer.convert_tokens_to_ids([THINK_OPEN, THINK_CLOSE])
    assert ids.count(opening) == 1 and ids.count(closing) == 1


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"city": "São Paulo", "days": 3}}',
        '{"a": [1, 2.50, -3e4, null, true], "b": "tab\\there \\"q\\" \\u00e9"}',
        "  leading spaces,\n\nnew lines\r\n and trailing  ",
        "emoji 🙂 and 中文 and 1234567890",
    ],
)
def test_text_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_corpus_chats_round_trip_and_prompt_is_a_token_prefix(tokenizer):
    for example in generate_examples(40, seed=9):
        full = tokenizer.apply_chat_template(example.chat(), tools=example.tools, tokenize=False)
        prompt = tokenizer.apply_chat_template(
            example.messages, tools=example.tools, tokenize=False, add_generation_prompt=True
        )
        assert full.startswith(prompt)
        full_ids = tokenizer.encode(full, add_special_tokens=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert full_ids[: len(prompt_ids)] == prompt_ids
        assert tokenizer.decode(full_ids) == full


def test_generation_prompt_ends_inside_thinking(tokenizer):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    think_open = tokenizer.convert_tokens_to_ids(THINK_OPEN)
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-2] == think_open and tokenizer.decode(ids[-1:]) == "\n"
    assert THINK_OPEN not in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=False
    )


def test_chat_template_renders_system_tools_reasoning_and_tool_calls(tokenizer):
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "call f"},
        {
            "role": "assistant",
            "reasoning_content": "use f",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
    ]
    text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False)
    system = text.split("<|eot_id|>")[0]
    assert system.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\n")
    assert system.endswith("\n" + json.dumps(tool["function"]))
    assert text.endswith('<think>\nuse f\n</think>{"name": "f", "arguments": {"x": 1}}<|eot_id|>')
    no_system = tokenizer.apply_chat_template(messages[1:2], tokenize=False)
    assert no_system == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\ncall f<|eot_id|>"


def test_training_is_deterministic():
    first = train_tokenizer(seed=1, num_examples=300, vocab_size=400)
    second = train_tokenizer(seed=1, num_examples=300, vocab_size=400)
    assert len(first) == 400
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
