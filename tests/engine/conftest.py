"""A tiny random Llama 3 over the shipped tokenizer, with every Llama draft, for engine tests."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tandem.assets import ASSETS_DIR
from tandem.models.loading import load_draft, load_target
from tests.models.conftest import save_tiny_llama
from tests.models.test_eagle import write_eagle
from tests.models.test_eagle3 import write_eagle3

LLAMA_DRAFTS = ("ngram", "eagle", "eagle3")


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")


@pytest.fixture(scope="session")
def llama_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-llama")
    vocab = len(tokenizer)
    save_tiny_llama(root / "target", vocab_size=vocab)
    write_eagle(root / "eagle", vocab=vocab)
    write_eagle3(root / "eagle3", vocab=vocab, draft_vocab=512)
    return {"target": root / "target", "eagle": root / "eagle", "eagle3": root / "eagle3"}


@pytest.fixture(scope="session")
def llama_target(llama_dirs):
    return load_target(llama_dirs["target"])


@pytest.fixture(scope="session")
def llama_drafts(llama_dirs, llama_target):
    """Each draft kind, loaded against the tiny target (EAGLE-3 overrides its aux layers)."""
    return {kind: load_draft(kind if kind == "ngram" else llama_dirs[kind], llama_target) for kind in LLAMA_DRAFTS}
