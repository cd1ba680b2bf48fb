"""Errors of the grammar pipeline. Each says what was wrong and where."""

from __future__ import annotations


class GrammarError(ValueError):
    """Base class: a grammar could not be turned into a matcher."""


class InvalidGrammarSpec(GrammarError):
    """The spec itself is malformed (bad JSON schema, regex, grammar text or choice list)."""


class GrammarRefused(GrammarError):
    """The backend would silently approximate the spec; `unhonoured` lists `pointer: keyword` items."""

    def __init__(self, backend: str, unhonoured: list[str]):
        self.backend = backend
        self.unhonoured = unhonoured
        super().__init__(
            f"backend {backend!r} cannot honour {', '.join(unhonoured)}; "
            "pass strict=False to accept the approximation or choose another backend"
        )


class GrammarCompileError(GrammarError):
    """The backend failed to compile a valid spec (unsupported feature, resource limit)."""


class GrammarCompileTimeout(GrammarError):
    """Compilation did not finish within the compiler's time limit."""
