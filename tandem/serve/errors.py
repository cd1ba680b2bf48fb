"""Errors the server returns, in OpenAI's error-object shape.

Every failure a client can cause becomes an `APIError` with an HTTP status and the body
`{"error": {"message", "type", "param", "code"}}`; `from_exception` maps the library's own
errors (pydantic validation, grammar, prompt length, sampling ranges) onto it.
"""

from __future__ import annotations

from typing import Any

import pydantic

from tandem.engine import PromptTooLongError
from tandem.grammars.errors import GrammarError, GrammarRefused, InvalidGrammarSpec


class APIError(Exception):
    """A request failure with its HTTP status; `param` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        """The JSON response body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def from_validation(error: pydantic.ValidationError) -> APIError:
    """400 naming the first invalid field as a dotted path (`messages.0.role`)."""
    first = error.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    where = f"{param}: " if param else ""
    codes = {"missing": "missing_required_parameter", "unsupported_parameter": "unsupported_parameter"}
    return invalid(f"{where}{first['msg']}", param=param, code=codes.get(first["type"], "invalid_value"))


def from_exception(error: Exception, *, schema_param: str, prompt_param: str, grammar: bool = False) -> APIError:
    """Map an engine-side error raised while admitting a request to the APIError it deserves.

    schema_param: the request field the grammar came from (`response_format`, `tools`, `guided_grammar`);
    prompt_param: the field holding the prompt (`messages`, `prompt`);
    grammar: whether that field holds grammar text (GBNF/EBNF or Lark), whose parse error is `invalid_grammar`.
    """
    if isinstance(error, APIError):
        return error
    if isinstance(error, PromptTooLongError):
        return invalid(str(error), param=prompt_param, code="context_length_exceeded")
    if isinstance(error, InvalidGrammarSpec) and grammar:
        return invalid(f"{schema_param}: {error}", param=schema_param, code="invalid_grammar")
    if isinstance(error, InvalidGrammarSpec):
        return invalid(f"invalid schema: {error}", param=schema_param, code="invalid_schema")
    if isinstance(error, GrammarRefused):
        return invalid(f"unsupported schema: {error}", param=schema_param, code="unsupported_schema")
    if isinstance(error, GrammarError):
        return invalid(f"schema could not be compiled: {error}", param=schema_param, code="unsupported_schema")
    if isinstance(error, ValueError):  # SamplingParams ranges, empty prompt
        return invalid(str(error), code="invalid_value")
    return APIError(500, f"internal error: {type(error).__name__}: {error}", type="internal_error")
