"""Typed model configs: a checkpoint's ``config.json``, read once into one frozen dataclass per architecture.

Each config is built by ``from_dict`` from the parsed file (as :func:`tandem.models.loading.read_config`
returns it), which :func:`~tandem.models.loading.load_target` and
:func:`~tandem.models.loading.load_draft` call once; the providers read typed fields only.

- Every default is a field default. Keys the file does not know are ignored, and a key set to
  ``null`` counts as absent.
- Values that follow from others when the file leaves them out (``head_dim``,
  ``num_key_value_heads``) are filled in at construction; values computed from several fields
  are properties (:attr:`DeepseekV3Config.latent_dim`).
- What the providers do not support is rejected here, with a ``ValueError`` naming the entry,
  before any weight is read.
- RoPE settings come in two spellings: transformers 5 writes ``rope_parameters``, the published
  Llama 3 and DeepSeek-V3 configs ``rope_scaling`` + ``rope_theta``. :class:`RopeParameters` reads
  both into one shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar

_CONVERT = {"bool": bool, "float": float}  # field annotation -> how a JSON value becomes it


def _entries(cls: type, config: dict[str, Any], model: str) -> dict[str, Any]:
    """The fields of dataclass ``cls`` that ``config`` sets (not null), bool and float fields converted.

    Raises ValueError listing the fields without a default that ``config`` lacks, in field order.
    """
    required = [f.name for f in dataclasses.fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if config.get(name) is None]
    if missing:
        raise ValueError(f"{model} config.json lacks {missing}")
    entries = {}
    for f in dataclasses.fields(cls):
        value = config.get(f.name)
        if value is not None:
            convert = _CONVERT.get(f.type)
            entries[f.name] = value if convert is None else convert(value)
    return entries


def _fill(config: Any, **values: Any) -> None:
    """Set fields of a frozen dataclass during its ``__post_init__`` (values derived from other fields)."""
    for name, value in values.items():
        object.__setattr__(config, name, value)


@dataclass(frozen=True, kw_only=True)
class RopeParameters:
    """A model's rotary settings, whatever the config's vintage (see the module docstring), with
    transformers' rope types (``transformers.modeling_rope_utils``) and the entries each needs
    (:data:`ROPE_REQUIRED`; :mod:`tandem.models.rope` computes them):

    ``"default"`` uses ``rope_theta`` only; ``"linear"`` divides the frequencies by ``factor``;
    ``"dynamic"`` (NTK-aware) stretches ``rope_theta`` once a row outgrows ``max_position_embeddings``
    (the model's), by ``factor``; ``"llama3"`` (Llama 3.1 frequency scaling) needs ``factor``,
    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``; ``"yarn"``
    (DeepSeek-V3 and Llama) reads the rest, with ``factor`` defaulting to ``max_position_embeddings /
    original_max_position_embeddings``; ``"longrope"`` scales each frequency by ``short_factor``, or
    by ``long_factor`` once a row outgrows ``original_max_position_embeddings``. As in transformers,
    ``original_max_position_embeddings`` of llama3, yarn and longrope is the config's top-level entry if
    it has one, else the rope settings', else ``max_position_embeddings``.
    """

    rope_type: str = "default"
    rope_theta: float = 10000.0  # the official EAGLE-3 Llama-3.1 draft config has none
    factor: float | None = None
    max_position_embeddings: int | None = None  # the model's (dynamic; longrope's default factor)
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope; None: their default from factor (and mscale)
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    short_factor: tuple[float, ...] | None = None  # longrope: [head_dim // 2] per-frequency divisors
    long_factor: tuple[float, ...] | None = None  # longrope, for rows past original_max_position_embeddings

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> RopeParameters:
        """From a model's config dict: ``rope_parameters``, else ``rope_scaling`` (``type`` read as
        ``rope_type``) with the top-level ``rope_theta``; lengths and YaRN's factor as the class says."""
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
        params.setdefault("rope_theta", config.get("rope_theta"))
        max_len = params["max_position_embeddings"] = config.get("max_position_embeddings")
        if params["rope_type"] in ("llama3", "yarn", "longrope"):
            original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
            params["original_max_position_embeddings"] = original = original or max_len
            if params["rope_type"] == "yarn" and not params.get("factor") and original:
                params["factor"] = max_len / original
        for key in ("short_factor", "long_factor"):
            if params.get(key) is not None:
                params[key] = tuple(float(f) for f in params[key])
        return cls(**_entries(cls, params, "RoPE"))

    def check(self, supported: tuple[str, ...], model: str) -> None:
        """Raise ValueError for a ``rope_type`` not in ``supported`` (by ``model``), or one without the
        entries it needs (:data:`ROPE_REQUIRED`)."""
        if self.rope_type not in supported:
            expected = " or ".join(repr(t) for t in supported)
            raise ValueError(f"rope_type {self.rope_type!r} is not supported for {model} (expected {expected})")
        missing = [key for key in ROPE_REQUIRED.get(self.rope_type, ()) if getattr(self, key) is None]
        if missing:
            raise ValueError(f"{model} config: rope_type {self.rope_type!r} lacks {missing}")


ROPE_REQUIRED = {  # rope_type -> the RopeParameters entries it cannot do without
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """A Llama 3 decoder stack: the target (:mod:`tandem.models.llama3`), and the shape of the
    decoder layer the EAGLE drafts reuse (:class:`EagleConfig`, :class:`Eagle3Config`)."""

    model: ClassVar[str] = "Llama"  # in error messages
    rope_types: ClassVar[tuple[str, ...]] = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: num_attention_heads (MHA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    rope: RopeParameters = field(default_factory=RopeParameters)

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"Llama config hidden_act={self.hidden_act!r} is not supported (expected 'silu')")
        self.rope.check(self.rope_types, "Llama")
        _fill(
            self,
            num_key_value_heads=self.num_key_value_heads or self.num_attention_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
        )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> LlamaConfig:
        """The config of a parsed ``config.json``; ValueError for what is missing or not supported."""
        return cls(**{**_entries(cls, config, cls.model), "rope": RopeParameters.from_dict(config)})


@dataclass(frozen=True, kw_only=True)
class EagleConfig(LlamaConfig):
    """An EAGLE-1/2 draft (:mod:`tandem.models.drafts.eagle`): ``fc`` then one Llama decoder layer."""

    model: ClassVar[str] = "EAGLE"

    vocab_size: int | None = None  # the target's
    num_hidden_layers: int = 1
    bias: bool = True  # whether ``fc`` has a bias

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_hidden_layers != 1:
            raise ValueError(f"EAGLE drafts have one decoder layer, config says {self.num_hidden_layers}")


@dataclass(frozen=True, kw_only=True)
class Eagle3Config(LlamaConfig):
    """An EAGLE-3 draft (:mod:`tandem.models.drafts.eagle3`): one Llama decoder layer over the fused
    aux hidden states, its own (possibly smaller) vocabulary."""

    model: ClassVar[str] = "EAGLE-3"

    vocab_size: int | None = None  # when set, must be the target's
    num_hidden_layers: int = 1
    draft_vocab_size: int | None = None  # None: the target's vocabulary
    target_hidden_size: int | None = None  # None: the target's hidden size
    # The target layers whose outputs are fused, SGLang/SpecForge convention (id i = output of layer i);
    # top level or under ``eagle_config``. None: the target's default capture points.
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 drafts have one decoder layer, config says {self.num_hidden_layers}")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Eagle3Config:
        key = "eagle_aux_hidden_state_layer_ids"
        ids = config.get(key) or (config.get("eagle_config") or {}).get(key)
        return super().from_dict({**config, key: None if ids is None else tuple(ids)})


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config:
    """DeepSeek-V3 (:mod:`tandem.models.deepseek_v3`): MLA attention, a routed MoE after the first
    ``first_k_dense_replace`` layers, and the MTP layers after ``num_hidden_layers``
    (:mod:`tandem.models.drafts.mtp`)."""

    model: ClassVar[str] = "DeepSeek-V3"
    rope_types: ClassVar[tuple[str, ...]] = ("default", "yarn")

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    q_lora_rank: int | None = None  # None: a full-rank q_proj
    hidden_act: str = "silu"
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    n_routed_experts: int | None = None  # None: every layer dense
    num_experts_per_tok: int | None = None  # needed with n_routed_experts
    moe_intermediate_size: int | None = None  # needed with n_routed_experts
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0
    rope: RopeParameters = field(default_factory=RopeParameters)

    def __post_init__(self) -> None:
        unsupported = {
            "hidden_act": (self.hidden_act, ("silu",)),
            "scoring_func": (self.scoring_func, ("sigmoid",)),
            "topk_method": (self.topk_method, ("noaux_tc",)),
            "rope_interleave": (self.rope_interleave, (True,)),
        }
        for key, (value, allowed) in unsupported.items():
            if value not in allowed:
                raise ValueError(f"DeepSeek-V3 config {key}={value!r} is not supported (expected one of {allowed})")
        if self.n_routed_experts:
            missing = [key for key in ("num_experts_per_tok", "moe_intermediate_size") if getattr(self, key) is None]
            if missing:
                raise ValueError(f"DeepSeek-V3 config.json lacks {missing}")
        self.rope.check(self.rope_types, self.model)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DeepseekV3Config:
        """The config of a parsed ``config.json``; ValueError naming the first missing or unsupported entry."""
        return cls(**{**_entries(cls, config, cls.model), "rope": RopeParameters.from_dict(config)})

    @property
    def latent_dim(self) -> int:
        """Numbers MLA caches per token and layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` (an MTP layer's too) runs the routed MoE, not a dense MLP."""
        return bool(self.n_routed_experts) and layer_id >= self.first_k_dense_replace

    @property
    def mtp_layer_ids(self) -> range:
        """Indices of the MTP/NextN layers stored after the decoder layers (``model.layers.{L}.*``, ...)."""
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)


@dataclass(frozen=True, kw_only=True)
class NgramConfig:
    """The model-free n-gram draft (:mod:`tandem.models.drafts.ngram`): suffix lengths tried, longest first."""

    model: ClassVar[str] = "n-gram"

    min_ngram: int = 2
    max_ngram: int = 5

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> NgramConfig:
        return cls(**_entries(cls, config, cls.model))


@dataclass(frozen=True, kw_only=True)
class SuffixConfig:
    """The model-free suffix draft (:mod:`tandem.models.drafts.suffix`): the trie's depth bound, the
    confidence rule (a proposed token's frequency at its node, and the running product) and the
    global store of recent outputs (in tokens; 0 turns it off)."""

    model: ClassVar[str] = "suffix"

    max_depth: int = 32
    min_token_prob: float = 0.1
    min_confidence: float = 0.0
    global_tokens: int = 0  # off by default: `tandem bench` repeats its prompts, which it would memorize

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SuffixConfig:
        return cls(**_entries(cls, config, cls.model))


TargetConfig = LlamaConfig | DeepseekV3Config
