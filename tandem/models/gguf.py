"""GGUF files (llama.cpp's format) of Llama-architecture models, as the Hugging Face directories tandem loads.

A GGUF holds its config as ``llama.*`` metadata, its tokenizer as ``tokenizer.ggml.*`` metadata, the chat
template as ``tokenizer.chat_template``, and its tensors under llama.cpp's names, quantized or not.
:func:`convert_gguf` reads it through the ``gguf`` package and writes ``config.json``,
``generation_config.json``, ``model.safetensors`` (shards past ``max_shard_bytes``), ``tokenizer.json`` and
``tokenizer_config.json``; :func:`gguf_directory` does so once per file into a cache. What transformers' GGUF
loading does well is reused, and the rest written here:

- config: transformers' table of ``llama.*`` keys (``GGUF_CONFIG_MAPPING``), plus what it leaves out: the
  RoPE scaling (``llama.rope.scaling.*``; for Llama 3.1 scaling, which llama.cpp stores as the tensor
  ``rope_freqs.weight``, the llama3 parameters fitted to that tensor: :func:`llama3_rope_parameters`), tied
  embeddings when ``output.weight`` is absent, attention biases, and the EOS list (eos, eot, eom ids).
- tensors: dequantized by ``gguf.quants.dequantize`` one at a time, renamed by transformers'
  ``get_gguf_hf_weights_map``, the Q/K rows un-permuted by its ``LlamaTensorProcessor`` (llama.cpp
  interleaves each head's two rotary halves for its RoPE kernel).
- tokenizer: transformers' builder (``get_gguf_tokenizer``, ``convert_gguf_tokenizer``), without the tokens
  it adds beyond the file's vocabulary, and adding BOS/EOS where the file's ``add_bos_token`` /
  ``add_eos_token`` say so (llama.cpp's behaviour).

Refused, with the reason named: an architecture other than ``llama``, a tensor type that ``gguf`` cannot
dequantize (type and tensor named), a tensor with no Hugging Face counterpart, split files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tandem.models.config import RopeParameters
from tandem.models.loading import DTYPES, resolve_dtype
from tandem.models.rope import rope_inv_freq

GGUF_CACHE_ENV = "TANDEM_GGUF_CACHE"  # where gguf_directory converts to (default: ~/.cache/tandem/gguf)
MAX_SHARD_BYTES = 4 << 30  # a shard is written once it reaches this: peak memory stays near one shard
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors of Llama 3.1 RoPE scaling


def gguf_directory(path: str | Path) -> Path:
    """The Hugging Face directory of GGUF file ``path``, converted on first use (default dtype).

    The cache entry, under ``$TANDEM_GGUF_CACHE`` (default ``~/.cache/tandem/gguf``), is keyed by the
    file's resolved path, size and modification time, so an edited file converts again. Conversions
    are staged and renamed into place: concurrent callers each get a complete directory.
    """
    path = Path(path)
    stat = path.stat()  # FileNotFoundError names the path
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get(GGUF_CACHE_ENV) or Path.home() / ".cache" / "tandem" / "gguf")
    target = root / f"{path.stem}-{key}"
    if not (target / "config.json").is_file():
        try:
            convert_gguf(path, target)
        except (OSError, ValueError):
            if not (target / "config.json").is_file():  # not a concurrent caller that finished first
                raise
    return target


def convert_gguf(
    file: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write GGUF ``file`` as a Hugging Face directory ``out_dir`` (new or empty); returns ``out_dir``.

    dtype: of the written weights: "bfloat16", "float16", "float32" (or the torch dtype); None keeps an
        unquantized file's float type (exact) and writes a quantized file's dequantized weights in bfloat16.
    Everything is checked (architecture, tensor types and names) before anything is written, and the
    directory is staged beside ``out_dir`` and renamed when complete, so a failure leaves nothing there.
    Raises ValueError for what cannot be converted, naming it.
    """
    from gguf import GGUFReader

    file, out_dir = Path(file), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty directory")
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such GGUF file")
    try:
        reader = GGUFReader(file)
    except ValueError as error:  # the package's own says neither which file nor that it is not a GGUF
        raise ValueError(f"{file}: not a readable GGUF file ({error})") from None
    architecture = _metadata(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(
            f"{file}: GGUF architecture {architecture!r} is not supported: tandem converts Llama-architecture "
            "files (general.architecture 'llama')"
        )
    if (_metadata(reader, "split.count") or 1) > 1:
        raise ValueError(f"{file} is one part of a split GGUF: merge the parts first (llama-gguf-split --merge)")
    _check_dequantizable(file, reader)
    config, eos_token_ids = _config(reader, _weight_dtype(reader, dtype))
    names = _hf_names(file, reader, config)
    tokenizer, tokenizer_config = _tokenizer(file, config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _save_weights(_tensors(reader, names, config), staging, max_shard_bytes)
        generation_config = {key: config[key] for key in ("bos_token_id", "pad_token_id") if key in config}
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", {**generation_config, "eos_token_id": eos_token_ids})
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def llama3_rope_parameters(divisors: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """The ``rope_parameters`` of Llama 3.1 scaling that llama.cpp stored as ``rope_freqs.weight``.

    divisors: ``[head_dim // 2] float32``, frequency i divided by ``divisors[i]``: 1 for wavelengths
    shorter than ``L / high_freq_factor``, ``factor`` past ``L / low_freq_factor``, and between them
    ``1 / ((1 - s) / factor + s)`` with ``s = (L / wavelength - low) / (high - low)`` (transformers'
    ``llama3`` rule, ``L`` = ``original_max_position_embeddings``). ``s`` is linear in ``1 / wavelength``,
    so a line fitted through the band's frequencies gives ``L / (high - low)`` and ``low / (high - low)``;
    only those ratios matter, and ``low_freq_factor = 1`` (every published Llama 3.x) fixes the rest.
    A band of fewer than two frequencies fixes ``high_freq_factor = 4`` too. The result is checked: tandem's
    own inverse frequencies from it must be llama.cpp's within float32 rounding, else ValueError.
    """
    factor = float(divisors.max())
    if factor == 1.0:
        return {"rope_type": "default", "rope_theta": rope_theta}
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * math.pi / inv_freq
    smooth = (1 / divisors.astype(np.float64) - 1 / factor) / (1 - 1 / factor)  # 1: unscaled, 0: by factor
    band = (smooth > 1e-6) & (smooth < 1 - 1e-6)
    low = 1.0
    if band.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelength[band], smooth[band], 1)  # s = L/(h-l) / w - l/(h-l)
        high = low - low / intercept
        original = slope * (high - low)
    else:
        high = 4.0
        if band.any():  # one frequency in the band: L from its s
            original = float(wavelength[band][0] * (smooth[band][0] * (high - low) + low))
        else:  # any L between the plateaus (the scaled one holds the largest divisor): their geometric middle
            unscaled, upper = wavelength[smooth >= 1 - 1e-6], wavelength[smooth <= 1e-6].min() * low
            original = math.sqrt(unscaled.max() * high * upper) if unscaled.size else upper / 2
    params = {
        "rope_type": "llama3",
        "rope_theta": rope_theta,
        "factor": _round(factor),
        "low_freq_factor": low,
        "high_freq_factor": _round(high),
        "original_max_position_embeddings": round(original),
    }
    rope = RopeParameters.from_dict({"rope_parameters": params})
    expected = torch.from_numpy(inv_freq / divisors.astype(np.float64)).float()
    if not torch.allclose(rope_inv_freq(rope, head_dim), expected, rtol=1e-5, atol=0):
        raise ValueError(f"{ROPE_FREQS} does not follow Llama 3.1 RoPE scaling (fitted: {params})")
    return params


def _round(value: float) -> float:
    """``value`` to 6 significant digits: what a config writes (4.0, not 3.9999997)."""
    return float(f"{value:.6g}")


def _metadata(reader, key: str) -> Any:
    """Scalar metadata ``key`` (int, float, bool or str), None when absent.

    float32 values come back as their shortest decimal (``1e-05``, not ``9.99999974e-06``); an array
    where a scalar belongs (a per-layer head count) is a ValueError: not a plain Llama.
    """
    from gguf import GGUFValueType
    from transformers.modeling_gguf_pytorch_utils import read_field

    if key not in reader.fields:
        return None
    field = reader.fields[key]
    if field.types[0] == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key} is an array (one value per layer?): not a plain Llama")
    (value,) = read_field(reader, key)
    return float(str(np.float32(value))) if field.types[0] == GGUFValueType.FLOAT32 else value


def _check_dequantizable(file: Path, reader) -> None:
    """ValueError naming the first tensor of each type that ``gguf.quants.dequantize`` cannot read.

    One zero block of each type is dequantized as the probe: what the package implements is its own business.
    """
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    first_of_type = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor.name)
    for qtype, name in first_of_type.items():
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
        except NotImplementedError:
            raise ValueError(
                f"{file}: tensor {name!r} is {qtype.name}, which the gguf package cannot dequantize"
            ) from None


def _weight_dtype(reader, dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype weights are written in (see :func:`convert_gguf`)."""
    from gguf import GGMLQuantizationType as T

    types = {tensor.tensor_type for tensor in reader.tensors}
    exact = "float32" if types <= {T.F32} else "float16" if types <= {T.F32, T.F16} else "bfloat16"
    return resolve_dtype(dtype, {"dtype": exact})  # a quantized file falls to bfloat16 too


def _config(reader, dtype: torch.dtype) -> tuple[dict[str, Any], list[int]]:
    """``config.json`` of the file (its ``eos_token_id`` the file's EOS), and every end-of-sequence id
    the file names (eos, eot, eom) for ``generation_config.json``."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    for key, name in GGUF_CONFIG_MAPPING["llama"].items():
        if name is not None and (value := _metadata(reader, f"llama.{key}")) is not None:
            config[name] = value
    config.setdefault("num_key_value_heads", config["num_attention_heads"])  # the Q/K un-permutation needs both
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config["vocab_size"] = int(tensors["token_embd.weight"].shape[1])  # ggml order: [hidden, vocab]
    key_length = _metadata(reader, "llama.attention.key_length")
    if key_length is not None and config.setdefault("head_dim", key_length) != key_length:
        raise ValueError(f"rope.dimension_count {config['head_dim']} != head dim {key_length}: partial RoPE")
    head_dim = config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config["rope_parameters"] = _rope_parameters(reader, config.pop("rope_theta", 10000.0), head_dim, tensors)
    config["tie_word_embeddings"] = "output.weight" not in tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    config["hidden_act"] = "silu"
    config["dtype"] = str(dtype).removeprefix("torch.")
    for key, name in GGUF_CONFIG_MAPPING["tokenizer"].items():  # bos, unk, pad ids (EOS just below)
        if name != "eos_token_id" and (token_id := _metadata(reader, f"tokenizer.{key}")) is not None:
            config[name] = token_id
    eos = [_metadata(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos_token_ids = list(dict.fromkeys(token for token in eos if token is not None))
    if not eos_token_ids:
        raise ValueError("the GGUF names no end-of-sequence token (tokenizer.ggml.eos_token_id)")
    config["eos_token_id"] = eos_token_ids[0]
    return config, eos_token_ids


def _rope_parameters(reader, rope_theta: float, head_dim: int, tensors: dict) -> dict[str, Any]:
    """``rope_parameters`` from ``llama.rope.scaling.*``, or Llama 3.1 scaling from ``rope_freqs.weight``."""
    from gguf.quants import dequantize

    if ROPE_FREQS in tensors:
        divisors = dequantize(tensors[ROPE_FREQS].data, tensors[ROPE_FREQS].tensor_type)
        return llama3_rope_parameters(divisors, rope_theta, head_dim)
    kind = _metadata(reader, "llama.rope.scaling.type") or "none"
    scaling = {
        name: value
        for name, key in (
            ("factor", "factor"),
            ("original_max_position_embeddings", "original_context_length"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        )
        if (value := _metadata(reader, f"llama.rope.scaling.{key}")) is not None
    }
    if kind == "none":
        return {"rope_type": "default", "rope_theta": rope_theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": rope_theta, "factor": scaling["factor"]}
    if kind == "yarn":
        return {"rope_type": "yarn", "rope_theta": rope_theta, **scaling}
    raise ValueError(f"GGUF RoPE scaling type {kind!r} is not supported (expected none, linear or yarn)")


def _hf_names(file: Path, reader, config: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face key, from transformers' map over a Llama built on the meta device;
    ValueError listing the tensors without one (``rope_freqs.weight`` went into the config)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    names = get_gguf_hf_weights_map(model, LlamaTensorProcessor(config))
    unknown = [t.name for t in reader.tensors if t.name not in names and t.name != ROPE_FREQS]
    if unknown:
        raise ValueError(f"{file}: tensors with no counterpart in a Hugging Face Llama: {unknown[:10]}")
    return names


def _tensors(reader, names: dict[str, str], config: dict[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """``(Hugging Face key, tensor)`` per GGUF tensor, dequantized, Q/K un-permuted, in ``config["dtype"]``."""
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config)
    dtype = DTYPES[config["dtype"]]
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        values = processor.process(dequantize(tensor.data, tensor.tensor_type), tensor.name).weights
        yield names[tensor.name], torch.tensor(values).to(dtype)  # a copy: the file is mapped read-only


def _save_weights(tensors: Iterable[tuple[str, Tensor]], out_dir: Path, max_shard_bytes: int) -> None:
    """``model.safetensors``, or shards of at most ``max_shard_bytes`` (a larger tensor alone) and their
    ``model.safetensors.index.json``, written as they fill."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    pending: dict[str, Tensor] = {}

    def flush() -> None:
        save_file(pending, out_dir / f"shard-{len(shards)}.safetensors", metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    size = 0
    for key, tensor in tensors:
        if pending and size + tensor.nbytes > max_shard_bytes:
            flush()
            size = 0
        pending[key] = tensor
        size += tensor.nbytes
    flush()
    if len(shards) == 1:
        (out_dir / "shard-0.safetensors").rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / f"shard-{i}.safetensors").rename(out_dir / name)
        weight_map.update(dict.fromkeys(keys, name))
    _write_json(out_dir / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def _tokenizer(file: Path, config: dict[str, Any]):
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` of the file's ``tokenizer.ggml.*`` metadata."""
    from tokenizers import Tokenizer, processors
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, vocabulary, settings = get_gguf_tokenizer(str(file))
    backend, _ = convert_gguf_tokenizer(architecture, vocabulary)
    # The byte-level builder adds GPT-2's own <|endoftext|> past the vocabulary, which the model has no row for.
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [token for token in spec["added_tokens"] if token["id"] < len(vocabulary["tokens"])]
    backend = Tokenizer.from_str(json.dumps(spec))
    # llama.cpp adds BOS / EOS around every text as the file's add_*_token flags say
    prefix, suffix, special = [], [], []
    for kind, edge in (("bos", prefix), ("eos", suffix)):
        if settings.get(f"add_{kind}_token") and settings.get(f"{kind}_token") is not None:
            edge.append(settings[f"{kind}_token"])
            special.append((settings[f"{kind}_token"], vocabulary[f"{kind}_token_id"]))
    backend.post_processor = processors.TemplateProcessing(
        single=[*prefix, "$A", *suffix], pair=[*prefix, "$A", *suffix, *prefix, "$B:1", *suffix], special_tokens=special
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{kind}_token": settings.get(f"{kind}_token") for kind in ("bos", "eos", "unk", "pad")},
        "chat_template": settings.get("chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings"),
    }
    return backend, {key: value for key, value in tokenizer_config.items() if value is not None}


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
