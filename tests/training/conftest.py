"""A tiny Llama target made here: random weights in the Hugging Face layout, the demo tokenizer and template."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tandem.assets import TOKENIZER_DIR
from tandem.training.data import DEFAULT_PROMPTS, read_prompts


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A 4-layer Llama (hidden 64) with random weights, float32; its greedy answers are what drafts learn."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.05,  # answers in short loops that vary with the prompt: learnable, not trivial
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    directory = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / file, directory / file)
    return directory


@pytest.fixture(scope="session")
def prompts():
    return read_prompts(DEFAULT_PROMPTS)
