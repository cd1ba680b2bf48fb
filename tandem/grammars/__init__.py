"""Structured output for speculative steps.

GrammarSpec (what to match) -> GrammarCompiler / compile_grammar (a backend's CompiledGrammar,
refusing silent approximations) -> SpeculativeMasker (per-position [B, k+1, W] masks and commits,
with a ThinkingTracker per reasoning row) -> MaskPipeline (masks overlapped with the forward).
"""

from tandem.grammars.compiler import GrammarCompiler, compile_grammar
from tandem.grammars.errors import GrammarCompileError, GrammarCompileTimeout, GrammarError, GrammarRefused, InvalidGrammarSpec
from tandem.grammars.masks import SpeculativeMasker
from tandem.grammars.overlap import MaskPipeline
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.thinking import ThinkingMarkers, ThinkingTracker
from tandem.grammars.tokenizer import GrammarTokenizer

__all__ = [
    "GrammarCompileError", "GrammarCompileTimeout", "GrammarCompiler", "GrammarError", "GrammarRefused",
    "GrammarSpec", "GrammarTokenizer", "InvalidGrammarSpec", "MaskPipeline", "SpeculativeMasker",
    "ThinkingMarkers", "ThinkingTracker", "compile_grammar",
]  # fmt: skip
