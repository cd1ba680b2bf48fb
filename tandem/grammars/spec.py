"""GrammarSpec: what a request's output must match, validated on construction.

Kinds: `json_schema` (dict, JSON text or pydantic model class), `regex`, `lark` (llguidance's Lark
dialect), `ebnf` (GBNF, xgrammar's dialect) and `choice` (one of a list of literal strings, compiled
as an escaped regex alternation). `strict=True` (default) refuses a backend that would silently
ignore part of a JSON schema; `strict=False` accepts its approximation. A JSON schema may be written
in any draft from 4 to 2020-12 (its `$schema`, or inferred: `normalize.schema_validator`) and is
checked against that draft's metaschema; the compiler rewrites it to 2020-12 (`normalize.py`).

JSON grammars bound the whitespace between JSON tokens (`whitespace`, see `tandem.core.checks.JsonWhitespace`): an
unbounded run is a way for a model to never close its answer.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import jsonschema
import llguidance
import xgrammar

from tandem.core.checks import JSON_WHITESPACE_RULE, JsonWhitespace, is_json_whitespace
from tandem.grammars.errors import InvalidGrammarSpec
from tandem.grammars.normalize import json_pointer, schema_validator

GrammarKind = Literal["json_schema", "regex", "lark", "ebnf", "choice"]
# A JSON schema's nesting depth (`json_depth`) at most: deeper ones (about 180 levels) recurse past
# Python's default limit while checked against their metaschema, and llguidance's parser stops near 128.
MAX_SCHEMA_DEPTH = 128


def check_json_whitespace(value: object, name: str = "whitespace") -> None:
    """Raise ValueError unless `value` is a JsonWhitespace."""
    if not is_json_whitespace(value):
        rule = f"{JSON_WHITESPACE_RULE} (at most that many whitespace characters between tokens)"
        raise ValueError(f"{name} = {value!r} must be {rule}")


_REGEX_SPECIAL = re.compile(r"([\\.^$|?*+()\[\]{}/-])")


@functools.lru_cache(maxsize=1024)
def _schema_error(source: str) -> str | None:
    """What is wrong with the schema of JSON text `source` (None: a valid schema) in its draft
    (`normalize.schema_validator`). Cached: checking against the metaschema costs milliseconds, and
    a server sees the same schemas again and again."""
    schema = json.loads(source)
    validator = schema_validator(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        return f"json_schema at {json_pointer(list(e.path)) or '/'}: {e.message}"
    return None


@functools.lru_cache(maxsize=1024)
def _lark_error(grammar: str) -> str | None:
    """What llguidance's Lark parser finds wrong with `grammar` (None: it parses). Cached, as `_schema_error` is:
    validating costs about a millisecond, and every job of a request (the runner's compile, then each
    `Engine.add_request`) and a server's next requests bring the same text again."""
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) or None


@functools.lru_cache(maxsize=1024)
def _ebnf_error(grammar: str) -> str | None:
    """What xgrammar's GBNF/EBNF parser finds wrong with `grammar` (None: it parses); cached as `_lark_error`.
    `GrammarSpec.grammar` asks it first of every text, Lark ones too."""
    try:
        xgrammar.Grammar.from_ebnf(grammar)
    except Exception as e:  # xgrammar raises RuntimeError with the parser's message
        return str(e).strip()
    return None


def json_depth(value: object) -> int:
    """How deeply objects and arrays nest in a JSON value: 0 for a scalar, 1 for `{}` or `[1]`.
    Iterative, so that a value too deep for recursion is measured rather than crashing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


def escape_regex_literal(text: str) -> str:
    """Escape `text` so that every backend's regex dialect matches it literally."""
    return _REGEX_SPECIAL.sub(r"\\\1", text)


@dataclass(frozen=True)
class GrammarSpec:
    """An immutable, hashable, validated grammar description; build it with the classmethods.

    `source` is the canonical text: JSON text for `json_schema` and `choice`, the pattern or
    grammar text otherwise. `whitespace` (json_schema only, else None) bounds the whitespace
    between JSON tokens (`JsonWhitespace`). Equal specs compile to the same grammar (it is the
    cache key).
    """

    kind: GrammarKind
    source: str
    strict: bool = True
    whitespace: JsonWhitespace | None = None

    @classmethod
    def json_schema(
        cls,
        schema: dict[str, Any] | bool | str | type,
        *,
        strict: bool = True,
        whitespace: JsonWhitespace = "compact",
    ) -> GrammarSpec:
        """From a schema dict/bool, its JSON text, or a pydantic model class (`model_json_schema()`).

        `whitespace`: what may stand between JSON tokens (`JsonWhitespace`); "compact" here, while
        requests (`SamplingParams.json_whitespace`) default to "default", json.dumps's separators.
        Raises InvalidGrammarSpec naming the JSON pointer of the first invalid subschema, for a
        schema nested deeper than MAX_SCHEMA_DEPTH, or for an invalid `whitespace`.
        """
        try:
            check_json_whitespace(whitespace)
        except ValueError as e:
            raise InvalidGrammarSpec(f"json_schema: {e}") from None
        if whitespace == 0:
            whitespace = "compact"  # one spelling per grammar: one cache entry
        if isinstance(schema, type):
            if not hasattr(schema, "model_json_schema"):
                raise InvalidGrammarSpec(f"json_schema: {schema.__name__} is not a pydantic model class")
            schema = schema.model_json_schema()
        elif isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise InvalidGrammarSpec(f"json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
            except json.JSONDecodeError as e:
                raise InvalidGrammarSpec(
                    f"json_schema: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}"
                ) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidGrammarSpec(
                f"json_schema: a schema must be an object or a boolean, got {type(schema).__name__}"
            )
        if (depth := json_depth(schema)) > MAX_SCHEMA_DEPTH:
            raise InvalidGrammarSpec(
                f"json_schema: objects and arrays nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are supported"
            )
        source = json.dumps(schema, ensure_ascii=False)
        error = _schema_error(source)
        if error is not None:
            raise InvalidGrammarSpec(error)
        return cls("json_schema", source, strict, whitespace)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """From a regular expression (the whole output must match). Checked with Python's `re`."""
        try:
            re.compile(pattern)
        except re.error as e:
            raise InvalidGrammarSpec(f"regex: {e.msg} at position {e.pos} in {pattern!r}") from None
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        """From a Lark grammar (llguidance's dialect, start rule `start`)."""
        error = _lark_error(grammar)
        if error is not None:
            raise InvalidGrammarSpec(f"lark: {error}")
        return cls("lark", grammar)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        """From a GBNF/EBNF grammar (xgrammar's dialect, start rule `root`)."""
        error = _ebnf_error(grammar)
        if error is not None:
            raise InvalidGrammarSpec(f"ebnf: {error}")
        return cls("ebnf", grammar)

    @classmethod
    def grammar(cls, grammar: str) -> GrammarSpec:
        """From grammar text in either dialect: GBNF/EBNF when it parses as xgrammar's (as vLLM
        reads `grammar`), else Lark when it parses as llguidance's; else InvalidGrammarSpec naming both errors."""
        try:
            return cls.ebnf(grammar)
        except InvalidGrammarSpec as ebnf_error:
            try:
                return cls.lark(grammar)
            except InvalidGrammarSpec as lark_error:
                raise InvalidGrammarSpec(
                    f"grammar is neither GBNF/EBNF nor Lark: {ebnf_error}; {str(lark_error).strip()}"
                ) from None

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        """The output is exactly one of `options` (non-empty list of distinct strings)."""
        if isinstance(options, str) or not options:
            raise InvalidGrammarSpec("choice: expected a non-empty list of strings")
        for i, option in enumerate(options):
            if not isinstance(option, str):
                raise InvalidGrammarSpec(f"choice at /{i}: expected a string, got {type(option).__name__}")
        if len(set(options)) != len(options):
            raise InvalidGrammarSpec("choice: options must be distinct")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @cached_property
    def schema(self) -> dict[str, Any] | bool:
        """The parsed JSON schema (json_schema specs only)."""
        if self.kind != "json_schema":
            raise TypeError(f"{self.kind} spec has no JSON schema")
        return json.loads(self.source)

    @cached_property
    def as_regex(self) -> str:
        """The regex this spec compiles to (regex and choice specs only)."""
        if self.kind == "regex":
            return self.source
        if self.kind == "choice":
            return "(" + "|".join(escape_regex_literal(o) for o in json.loads(self.source)) + ")"
        raise TypeError(f"{self.kind} spec has no regex form")
