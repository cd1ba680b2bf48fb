"""A Llama-family checkpoint unlike the demo's: tied embeddings, head_dim different from hidden / heads,
a byte-level BPE tokenizer and a chat template with no thinking markers (the tracker stays off), and a
generation_config.json listing two EOS ids. tandem's greedy tokens equal transformers' ``generate``."""

from __future__ import annotations

import json

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.request import thinking_markers
from tests.models.conftest import save_tiny_llama

CHAT_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
CORPUS = ["the quick brown fox jumps over the lazy dog", "speculative decoding keeps the target exact", "12 + 30 = 42"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("llama-family")
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    special = ["<|begin|>", "<|eot|>", "<|start|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(CORPUS * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin|>", eos_token="<|eot|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    assert "<think>" not in tokenizer.get_vocab()
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    save_tiny_llama(  # larger weights than HF's init, so greedy tokens vary; every id a token
        path,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        head_dim=32,
        num_hidden_layers=2,
        initializer_range=0.3,
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, end]}))
    return path


def test_greedy_tokens_equal_transformers_and_no_thinking_phase(model_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(model_dir), "ngram", num_speculative_tokens=3)
    assert thinking_markers(llm.tokenizer) is None
    prompt = llm.chat_prompt([{"role": "user", "content": "the quick brown fox"}])
    out = llm.generate([prompt], SamplingParams(max_tokens=24))[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    assert out.token_ids == expected
    assert out.reasoning == "" and out.text  # no thinking phase: everything is answer
