"""Grammar backends behind one `Matcher` protocol; `BACKENDS` maps a name to its module.

Each module exposes `NAME`, `KINDS` (the spec kinds it compiles) and
`compile(spec, tokenizer) -> Callable[[], Matcher]`.
"""

from __future__ import annotations

from types import ModuleType

from tandem.grammars.backends import llguidance, outlines, xgrammar
from tandem.grammars.backends.base import CompiledGrammar, Matcher

BACKENDS: dict[str, ModuleType] = {m.NAME: m for m in (xgrammar, llguidance, outlines)}

__all__ = ["BACKENDS", "CompiledGrammar", "Matcher"]
