"""GrammarTokenizer: one Hugging Face tokenizer as the grammar backends see it.

The backends each need their own view of the vocabulary (xgrammar's TokenizerInfo, llguidance's
LLTokenizer, outlines-core's Vocabulary); they are built once, lazily, and cached here. `vocab_size`
is the MODEL's vocab (logits width V), which may exceed the tokenizer's: ids past the tokenizer's
vocabulary, and special tokens other than EOS, are never allowed by a grammar.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase


class GrammarTokenizer:
    """A tokenizer plus the model's vocab size; `fingerprint` identifies it in compile caches."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None):
        tokenizer_size = len(hf_tokenizer)
        self.hf = hf_tokenizer
        self.vocab_size = tokenizer_size if vocab_size is None else vocab_size
        if self.vocab_size < tokenizer_size:
            raise ValueError(f"model vocab_size {self.vocab_size} < tokenizer size {tokenizer_size}")
        if hf_tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos_token_id; grammars need it to end the output")
        self.eos_token_id: int = hf_tokenizer.eos_token_id
        # Control tokens (<think>, BOS, reserved ids...) a grammar must never emit; EOS is the grammar's own.
        specials = set(hf_tokenizer.all_special_ids)
        specials |= {i for i, added in hf_tokenizer.added_tokens_decoder.items() if added.special}
        self.special_ids: frozenset[int] = frozenset(specials - {self.eos_token_id})
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else json.dumps(hf_tokenizer.get_vocab(), sort_keys=True)
        self.fingerprint = hashlib.sha256(f"{text}\0{self.vocab_size}".encode()).hexdigest()[:16]
        self._views: dict[str, Any] = {}
        self._lock = threading.Lock()

    def view(self, name: str, build: Callable[[GrammarTokenizer], Any]) -> Any:
        """The backend view `name`, built by `build(self)` on first use (thread-safe, cached)."""
        with self._lock:
            if name not in self._views:
                self._views[name] = build(self)
            return self._views[name]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        return self.hf.encode(text, add_special_tokens=False, verbose=False)
