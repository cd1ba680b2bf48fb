"""Engine test models: a tiny random Llama 3 over the shipped tokenizer with every Llama draft, and the shipped demo
models loaded once per module."""

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tandem.assets import ASSETS_DIR
from tandem.llm import resolve_draft, resolve_model
from tandem.models.linear import narrow_exact_weights
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


@pytest.fixture(scope="module")
def models():
    """``models(name, draft)`` -> (target, draft or None, tokenizer) of the shipped demo models, each loaded once
    (float32, narrowed)."""
    loaded = {}

    def get(name: str, draft: str | None):
        if name not in loaded:
            path = resolve_model(name)
            target = load_target(path, dtype=torch.float32)
            narrow_exact_weights(target)
            loaded[name] = (target, AutoTokenizer.from_pretrained(path))
        if draft is not None and (name, draft) not in loaded:
            loaded[name, draft] = load_draft(resolve_draft(draft, resolve_model(name)), loaded[name][0])
            if isinstance(loaded[name, draft], torch.nn.Module):
                narrow_exact_weights(loaded[name, draft])
        target, tokenizer = loaded[name]
        return target, None if draft is None else loaded[name, draft], tokenizer

    return get
