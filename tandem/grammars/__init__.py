"""Structured output for speculative steps.

GrammarSpec (what to match) -> GrammarCompiler / compile_grammar (a backend's CompiledGrammar,
refusing silent approximations) -> SpeculativeMasker (per-position [B, k+1, W] masks and commits,
with a `tandem.thinking.ThinkingTracker` per reasoning row). The engine overlaps the masks with
the forward (`tandem.engine.mask_pipeline`).
"""

from tandem.grammars.compiler import GrammarCompiler, compile_grammar
from tandem.grammars.errors import (
    GrammarCompileError,
    GrammarCompileTimeout,
    GrammarError,
    GrammarRefused,
    InvalidGrammarSpec,
)
from tandem.grammars.masks import SpeculativeMasker
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.tokenizer import GrammarTokenizer

__all__ = [
    "GrammarCompileError", "GrammarCompileTimeout", "GrammarCompiler", "GrammarError", "GrammarRefused",
    "GrammarSpec", "GrammarTokenizer", "InvalidGrammarSpec", "SpeculativeMasker", "compile_grammar",
]  # fmt: skip
