"""Per-row sampling settings as device tensors, and the relaxed-acceptance rule's knobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.core.checks import JSON_WHITESPACE_RULE, JsonWhitespace, is_json_whitespace
from tandem.core.transfer import Staging, to_device

MAX_LOGPROBS = 20  # SamplingParams.logprobs at most: alternatives per token, as OpenAI's top_logprobs allows

_FIELDS = {  # name -> dtype every SamplingTensors field must have
    "temperature": torch.float32,
    "top_k": torch.int64,
    "top_p": torch.float32,
    "min_p": torch.float32,
    "seed": torch.int64,
}


@dataclass(frozen=True)
class RelaxedAcceptance:
    """Relaxed acceptance for positions inside `<think>…</think>` (TensorRT-LLM's rule).

    A draft token d is also accepted when it is among the target's `top_k` most likely
    tokens of softmax(masked logits) and p(d) >= p(top1) - delta. `top_k=1, delta=0`
    is exactly greedy acceptance.
    """

    top_k: int = 10
    delta: float = 0.6

    def __post_init__(self) -> None:
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"RelaxedAcceptance.top_k must be an int >= 1, got {self.top_k!r}")
        if not 0.0 <= float(self.delta) <= 1.0:
            raise ValueError(f"RelaxedAcceptance.delta must be in [0, 1], got {self.delta!r}")


@dataclass(frozen=True)
class SamplingTensors:
    """Sampling settings, one entry per batch row.

    temperature: [B] float32   0 = greedy (the target distribution is the point mass at the masked argmax)
    top_k:       [B] int64     0 = off
    top_p:       [B] float32   1.0 = off; in (0, 1]
    min_p:       [B] float32   0.0 = off; in [0, 1]
    seed:        [B] int64     the row's random stream; same seed + same inputs = same tokens,
                               whatever else is in the batch. A caller that samples repeatedly
                               must pass a fresh seed per call (the engine mixes in the row's
                               position), or every call replays the same random numbers.

    Values are checked when the tensors live on the CPU (where they are normally built); the
    batch-wide flags below are computed once here so the hot path never asks the device.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    all_greedy: bool = field(init=False)
    any_greedy: bool = field(init=False)
    any_top_k_top_p: bool = field(init=False)
    any_min_p: bool = field(init=False)
    max_top_k: int = field(init=False)

    def __post_init__(self) -> None:
        batch = None
        for name, dtype in _FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dim() != 1:
                raise ValueError(f"SamplingTensors.{name} must be a 1-D tensor [B], got {_describe(value)}")
            if value.dtype != dtype:
                raise ValueError(f"SamplingTensors.{name} must be {dtype}, got {value.dtype}")
            if batch is not None and value.shape[0] != batch:
                raise ValueError(f"SamplingTensors.{name} has {value.shape[0]} rows, temperature has {batch}")
            batch = value.shape[0]
        devices = {getattr(self, name).device for name in _FIELDS}
        if len(devices) != 1:
            raise ValueError(f"SamplingTensors fields are on different devices: {sorted(map(str, devices))}")
        if self.temperature.device.type == "cpu":
            _check_range("temperature", self.temperature, self.temperature >= 0, ">= 0")
            _check_range("top_k", self.top_k, self.top_k >= 0, ">= 0")
            _check_range("top_p", self.top_p, (self.top_p > 0) & (self.top_p <= 1), "in (0, 1]")
            _check_range("min_p", self.min_p, (self.min_p >= 0) & (self.min_p <= 1), "in [0, 1]")
        object.__setattr__(self, "all_greedy", bool((self.temperature == 0).all()))
        object.__setattr__(self, "any_greedy", bool((self.temperature == 0).any()))
        object.__setattr__(self, "any_top_k_top_p", bool(((self.top_k > 0) | (self.top_p < 1)).any()))
        object.__setattr__(self, "any_min_p", bool((self.min_p > 0).any()))
        object.__setattr__(self, "max_top_k", int(self.top_k.max()) if batch else 0)

    @classmethod
    def greedy(cls, batch_size: int, device: torch.device | str = "cpu") -> SamplingTensors:
        """Every row greedy (temperature 0), no filters."""
        return cls.full(batch_size, temperature=0.0, device=device)

    @classmethod
    def full(
        cls,
        batch_size: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | torch.Tensor = 0,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Every row with the same settings; `seed` may be a [B] tensor of per-row seeds."""
        seeds = seed if isinstance(seed, torch.Tensor) else torch.full((batch_size,), seed, dtype=torch.int64)
        return cls(
            temperature=torch.full((batch_size,), temperature, dtype=torch.float32, device=device),
            top_k=torch.full((batch_size,), top_k, dtype=torch.int64, device=device),
            top_p=torch.full((batch_size,), top_p, dtype=torch.float32, device=device),
            min_p=torch.full((batch_size,), min_p, dtype=torch.float32, device=device),
            seed=seeds.to(device=device, dtype=torch.int64),
        )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    def to(self, device: torch.device | str, staging: Staging | None = None) -> SamplingTensors:
        """The same settings on `device` (from the CPU without waiting for the device: :func:`to_device`), a copy
        per field; with ``staging`` (bound for `device`), in its one copy with the rest of a step's phase, and
        then no device work may read them before it has sent."""
        if staging is None:
            return self._map(lambda value: to_device(value, device))
        return self._map(lambda v: staging.float32(v.tolist()) if v.is_floating_point() else staging.int64(v.tolist()))

    def repeat_rows(self, repeats: int) -> SamplingTensors:
        """Each row repeated `repeats` times, [B] -> [B * repeats]: one entry per draft position."""
        return self._map(lambda value: value.repeat_interleave(repeats))

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The settings of `rows` ([R] int64 row ids), in that order; the flags are those of the subset."""
        return SamplingTensors(**{name: getattr(self, name)[rows] for name in _FIELDS})

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingTensors:
        """Apply `fn` to every field; the flags are carried over, never recomputed (no device sync)."""
        mapped = object.__new__(SamplingTensors)
        for name in _FIELDS:
            object.__setattr__(mapped, name, fn(getattr(self, name)))
        for flag in ("all_greedy", "any_greedy", "any_top_k_top_p", "any_min_p", "max_top_k"):
            object.__setattr__(mapped, flag, getattr(self, flag))
        return mapped


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _check_range(name: str, value: torch.Tensor, ok: torch.Tensor, rule: str) -> None:
    if not bool(ok.all()):
        row = int((~ok).nonzero()[0, 0])
        raise ValueError(f"SamplingTensors.{name}[{row}] = {value[row].item()} must be {rule}")


@dataclass
class SamplingParams:
    """How to sample one request (the user-facing form; the engine batches these into
    SamplingTensors).

    temperature 0 = greedy; top_k 0, top_p 1.0 and min_p 0.0 switch their filter off.
    seed: None = a random seed drawn when the request is added; the same seed and prompt
    give the same output whatever else is in the batch.
    max_tokens: new tokens at most (reasoning included), never exceeded.
    stop: strings that end the answer; the text ends right before the first one found
    (reasoning inside `<think>…</think>` is never cut by a stop string).
    stop_token_ids: token ids that end the request like EOS (kept in token_ids, not in the text).
    At most one of json_schema (dict, JSON string or pydantic model class), regex, grammar
    (Lark/EBNF) and choice (list of strings) constrains the answer.
    json_whitespace: the whitespace a json_schema answer may have between JSON tokens.
    "default": exactly what `json.dumps` writes by default, ", " between items and ": " after
    keys, nothing elsewhere (the demo models' answers are written so); "compact": none (the
    separators "," and ":"); an int n in 0..64: at most n whitespace characters (space, tab,
    newline, carriage return) in each gap between tokens. Never unbounded: a grammar that lets
    whitespace run on lets a model write spaces until max_tokens (issue 30). A grammar backend
    that cannot express the mode exactly is not chosen (or, named explicitly, refuses).
    logprobs: None, or N in 0..20: return each generated token's log-probability under the
    target model (tandem.decoding.logprobs) and those of the N most likely tokens at its position.
    presence_penalty, frequency_penalty (in [-2, 2], 0 = off; OpenAI's) subtract from a token's logit
    once if it occurs in the output so far, and once per occurrence; repetition_penalty (> 0, 1 = off;
    HF's and vLLM's) divides a positive logit of a token seen in the prompt or output by it and
    multiplies a negative one; logit_bias maps token ids to values in [-100, 100] added to their
    logits (tandem.decoding.penalties has the order and the speculative semantics).
    ignore_eos: go on past the EOS tokens until max_tokens, a stop string or a stop token id (vLLM's: for
    benchmarks, whose random or free text must run a fixed length); refused with a constraint, which ends at EOS.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    json_schema: object | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_whitespace: JsonWhitespace = "default"
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "an int >= 0")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _require(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an int >= 1"
        )
        _require(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an int or None")
        _require(
            self.logprobs is None or isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            self.logprobs,
            f"None or an int in 0..{MAX_LOGPROBS}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, getattr(self, name), "in [-2, 2]")
        _require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _require(
            self.logit_bias is None
            or all(
                isinstance(token, int) and token >= 0 and -100 <= bias <= 100 for token, bias in self.logit_bias.items()
            ),
            "logit_bias",
            self.logit_bias,
            "a dict of token ids >= 0 to values in [-100, 100]",
        )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(all(isinstance(s, str) and s for s in self.stop or []), "stop", self.stop, "non-empty strings")
        _require(
            is_json_whitespace(self.json_whitespace), "json_whitespace", self.json_whitespace, JSON_WHITESPACE_RULE
        )
        constraints = [
            name for name in ("json_schema", "regex", "grammar", "choice") if getattr(self, name) is not None
        ]
        if len(constraints) > 1:
            raise ValueError(
                f"SamplingParams: give at most one of json_schema, regex, grammar, choice; got {constraints}"
            )
        if self.ignore_eos and constraints:
            raise ValueError(
                f"SamplingParams.ignore_eos: a constrained answer ends at EOS; drop it or {constraints[0]}"
            )

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a logit bias changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} = {value!r} must be {rule}")


def batch_sampling(
    params: list[SamplingParams],
    seeds: torch.Tensor,
    device: torch.device | str = "cpu",
    staging: Staging | None = None,
) -> SamplingTensors:
    """Stack per-request settings into SamplingTensors; `seeds` [B] int64 are this step's seeds. Checked on the
    host, then sent to `device` (in ``staging``'s copy: :meth:`SamplingTensors.to`)."""
    return SamplingTensors(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        seed=seeds.to(torch.int64).cpu(),
    ).to(device, staging)
