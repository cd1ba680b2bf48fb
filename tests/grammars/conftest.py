"""Fixtures: the shipped tokenizer (or, until it exists, a byte-level BPE trained here), grammars."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tandem.assets import ASSETS_DIR
from tandem.grammars.tokenizer import GrammarTokenizer

REPO = Path(__file__).resolve().parents[2]
MASKBENCH = Path(os.environ.get("TANDEM_MASKBENCH", REPO.parent / "shared" / "data" / "maskbench"))
SCHEMA_SUITE = Path(
    os.environ.get("TANDEM_SCHEMA_SUITE", REPO.parent / "shared" / "data" / "json-schema-test-suite" / "draft2020-12")
)

# A small schema and texts it accepts, shared by the property tests of all backends.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_TEXTS = [
    '{"name":"Ada","age":36}',
    '{"name":"Grace Hopper","age":85,"tags":["a","ccc"]}',
    '{"name":"","age":-7,"tags":[]}',
]


def _train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [json.dumps(PERSON_SCHEMA)] + PERSON_TEXTS * 20 + ["<think> reasoning about the answer </think>"]
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<think>", "</think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        additional_special_tokens=["<think>", "</think>"],
    ).save_pretrained(path)


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory):
    shipped = ASSETS_DIR / "tokenizer"
    if (shipped / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(shipped)
    path = tmp_path_factory.mktemp("tokenizer")
    _train_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def tokenizer(hf_tokenizer) -> GrammarTokenizer:
    """The model vocab is padded past the tokenizer's (as real checkpoints do) by 40 ids."""
    return GrammarTokenizer(hf_tokenizer, vocab_size=len(hf_tokenizer) + 40)


def fresh_mask(new_matcher, tokens, width):
    """The mask of a new matcher fed `tokens` directly: int32 [W]."""
    matcher = new_matcher()
    for token in tokens:
        assert matcher.accept_token(token)
    out = torch.zeros(1, width, dtype=torch.int32)
    matcher.fill_bitmask(out, 0)
    return out[0]
