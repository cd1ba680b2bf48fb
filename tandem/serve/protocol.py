"""Request bodies of the OpenAI-compatible API, validated with pydantic.

`ChatCompletionRequest` and `CompletionRequest` share the sampling fields of `SamplingRequest`;
`SamplingRequest.sampling_params` turns them into one `SamplingParams` per choice (n choices,
derived seeds), with vLLM's `repetition_penalty` beside OpenAI's penalties and `logit_bias`.
Ranges follow OpenAI's where it defines them; a violation is reported by
`errors.from_validation` as a 400 naming the field. Sampling fields OpenAI defines and tandem
does not implement (`UNSUPPORTED`) are refused unless they ask for nothing; unknown fields and
informational ones (`user`, `metadata`, ...) are ignored, as vLLM does. tandem's extension
`json_whitespace` bounds the whitespace of JSON answers (SamplingParams.json_whitespace).

What the answer must match (`SamplingRequest.constraint`) comes from OpenAI's `response_format`
or from the fields vLLM users send: `structured_outputs` {json, json_object, regex, choice,
grammar} and the older top-level `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`; at most one of them per request. Like `response_format`, they constrain the
answer only, never the reasoning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from tandem.core.checks import MAX_JSON_WHITESPACE
from tandem.decoding.params import MAX_LOGPROBS, SamplingParams
from tandem.serve.errors import invalid

MAX_N = 8  # choices per request; each one is a row of the engine batch
MAX_STOP = 4  # stop strings per request, as OpenAI allows
SEED_MODULUS = 2**63  # choice i of a seeded request samples with seed (seed + i) mod this
# OpenAI fields that would change the output and that tandem does not implement, with the values
# that ask for nothing (accepted, so that clients sending their defaults work).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class JSONSchemaFormat(_Body):
    """`response_format.json_schema`. tandem always enforces the schema exactly (or refuses it),
    so `strict` is accepted for compatibility and changes nothing."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class TextFormat(_Body):
    type: Literal["text"]


class JSONObjectFormat(_Body):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")]


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (the answer's constraint; `grammar` is GBNF/EBNF or Lark,
    `GrammarSpec.grammar`). Its backend options are ignored: tandem picks the backend that honours the
    constraint exactly. `structural_tag` is refused, since ignoring it would leave the answer free."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None

    @field_validator("structural_tag")
    @classmethod
    def _refuse_structural_tag(cls, value: Any) -> None:
        if value is not None:
            raise PydanticCustomError("unsupported_parameter", "tandem does not implement structural_tag")


@dataclass(frozen=True)
class Constraint:
    """What a request's answer must match: `kind` is the SamplingParams field that takes `value`;
    `param` is the request field it came from (`response_format`, `guided_regex`, ...)."""

    kind: Literal["json_schema", "regex", "choice", "grammar"]
    value: Any
    param: str


class SamplingRequest(_Body):
    """Fields shared by chat and text completions."""

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="-1 or 0: off (vLLM's and tandem's conventions)")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, description="vLLM's extension; 1: off")
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = Field(default=False, description="vLLM's extension: generate past EOS, up to max_tokens")
    json_whitespace: Literal["default", "compact"] | Annotated[StrictInt, Field(ge=0, le=MAX_JSON_WHITESPACE)] = Field(
        default="default",
        description="tandem's extension: whitespace between JSON tokens of a response_format or tool-call answer; "
        "'default' = json.dumps separators, 'compact' = none, n = at most n characters per gap",
    )
    echo: Any = None  # UNSUPPORTED: present so that a value asking for something is refused
    best_of: Any = None
    suffix: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = UNSUPPORTED[info.field_name]
        if value in neutral:
            return value
        raise PydanticCustomError(
            "unsupported_parameter",
            "tandem does not implement {field}; leave it out or send {ok}",
            {"field": info.field_name, "ok": " or ".join(map(json.dumps, neutral[1:]))},
        )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > MAX_STOP or not all(stops)):
            raise ValueError(f"at most {MAX_STOP} non-empty strings")
        return stops

    def constraint(self) -> Constraint | None:
        """What the answer must match (None: free text); a 400 APIError when two fields constrain it,
        or for a JSON schema given as text that is not JSON."""
        response_format, outputs = self.response_format, self.structured_outputs or StructuredOutputs()
        if isinstance(response_format, JSONSchemaResponseFormat):
            format_schema = response_format.json_schema.schema_
        else:
            format_schema = {"type": "object"} if isinstance(response_format, JSONObjectFormat) else None
        fields = [
            ("response_format", "json_schema", format_schema),
            ("structured_outputs.json", "json_schema", outputs.json_),
            ("structured_outputs.json_object", "json_schema", {"type": "object"} if outputs.json_object else None),
            ("structured_outputs.regex", "regex", outputs.regex),
            ("structured_outputs.choice", "choice", outputs.choice),
            ("structured_outputs.grammar", "grammar", outputs.grammar),
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        ]
        given = [Constraint(kind, value, param) for param, kind, value in fields if value is not None]
        if len(given) > 1:
            raise invalid(
                f"{given[0].param} and {given[1].param} both constrain the answer; give at most one",
                param=given[1].param,
                code="conflicting_constraints",
            )
        if not given:
            return None
        constraint = given[0]
        if constraint.kind != "json_schema" or not isinstance(constraint.value, str):
            return constraint
        try:  # vLLM takes a JSON schema as JSON text too
            return Constraint("json_schema", json.loads(constraint.value), constraint.param)
        except (json.JSONDecodeError, RecursionError) as error:
            message = f"{constraint.param}: the schema is not valid JSON: {error}"
            raise invalid(message, param=constraint.param, code="invalid_schema") from None

    def token_budget(self) -> int | None:
        """The request's cap on new tokens (None: up to the context length)."""
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: None, or how many most likely tokens to return beside each one."""
        return None

    def sampling_params(self, max_tokens: int, constraint: Constraint | None) -> list[SamplingParams]:
        """One SamplingParams per choice, the answer under `constraint`; choice i of a seeded request uses seed + i."""
        return [
            SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=max(self.top_k, 0),
                min_p=self.min_p,
                seed=None if self.seed is None else (self.seed + i) % SEED_MODULUS,
                max_tokens=max_tokens,
                stop=self.stop,
                **({constraint.kind: constraint.value} if constraint is not None else {}),
                json_whitespace=self.json_whitespace,
                logprobs=self.num_logprobs(),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                logit_bias=self.logit_bias or None,
                ignore_eos=self.ignore_eos,
            )
            for i in range(self.n)
        ]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined, `developer` read as `system`."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def token_budget(self) -> int | None:
        """`max_completion_tokens` (OpenAI's current name) or else `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the legacy API's top-N count

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list) -> str | list:
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, (str, list)) and not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one, or a batch)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)
