"""Loading Hugging Face-format directories into providers, without network.

A directory holds ``config.json`` and ``model.safetensors`` or a sharded
``model.safetensors.index.json``; drafts published only as ``pytorch_model.bin`` (or a sharded
``pytorch_model.bin.index.json``) are read with ``torch.load(weights_only=True)``. An FP8
block-quantized checkpoint (DeepSeek-V3's published layout) is dequantized tensor by tensor as it is
read (:mod:`tandem.models.fp8`); any other ``quantization_config`` is refused.

:func:`load_target` and :func:`load_draft` pick the provider module and its typed config
(:mod:`tandem.models.config`) from a small registry keyed by the config's ``architectures`` (first)
or ``model_type``, parse ``config.json`` into that config once, and call the builder every provider
module exposes::

    build(config: <its config>, weights: WeightReader | None, *, dtype: torch.dtype,
          device: torch.device, target: Target | None = None) -> Target | Draft

(``target`` is None for targets; ``weights`` is None for the model-free n-gram draft.) A target's
builder also takes ``shard: Shard`` (:mod:`tandem.models.parallel`): the rank's part of a parallel model,
which reads only its pieces of the tensors (``take(..., part=Part(...))``); one that cannot split raises
ValueError naming the model when ``shard.size > 1``.
Builders read tensors with ``weights.take(key, shape)``, which fails with an error naming the
key and both shapes, and end with ``weights.finish(ignore=...)``, which names every tensor of the
checkpoint the builder did not read.

Draft kinds: ``"ngram"``, ``"suffix"``, ``"mtp"`` (the MTP/NextN layer(s) after ``num_hidden_layers`` in the
target's own checkpoint), or a path to a draft checkpoint (EAGLE, EAGLE-3, NextN).
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor

from tandem.models import fp8
from tandem.models.base import Draft, Target
from tandem.models.config import DeepseekV3Config, Eagle3Config, EagleConfig, LlamaConfig, NgramConfig, SuffixConfig
from tandem.models.parallel import SINGLE, Shard

TARGET_MODULES = {  # config model_type -> (provider module, the config it is built from)
    "llama": ("tandem.models.llama3", LlamaConfig),
    "deepseek_v3": ("tandem.models.deepseek_v3", DeepseekV3Config),
}
DRAFT_MODULES = {  # config architectures[0] (or a kind name) -> (provider module, the config it is built from)
    "ngram": ("tandem.models.drafts.ngram", NgramConfig),
    "suffix": ("tandem.models.drafts.suffix", SuffixConfig),
    "mtp": ("tandem.models.drafts.mtp", DeepseekV3Config),
    "DeepseekV3ForCausalLMNextN": ("tandem.models.drafts.mtp", DeepseekV3Config),
    "EagleLlamaForCausalLM": ("tandem.models.drafts.eagle", EagleConfig),
    "LlamaForCausalLMEagle": ("tandem.models.drafts.eagle", EagleConfig),
    "LlamaForCausalLMEagle3": ("tandem.models.drafts.eagle3", Eagle3Config),
    "Eagle3LlamaForCausalLM": ("tandem.models.drafts.eagle3", Eagle3Config),
    "Eagle3DeepseekV2ForCausalLM": ("tandem.models.drafts.eagle3", Eagle3Config),
    "Eagle3DeepseekV3ForCausalLM": ("tandem.models.drafts.eagle3", Eagle3Config),
}
CHECKPOINT_FILES = (  # (sharded index, single file), in order of preference
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Part(NamedTuple):
    """Piece ``index`` of a stored tensor cut into ``count`` equal pieces along ``dim``: what one rank of a parallel
    group holds of a sharded weight (:class:`tandem.models.parallel.Shard`)."""

    dim: int
    index: int
    count: int

    def bounds(self, size: int) -> tuple[int, int]:
        """``(start, stop)`` of the piece along a dimension of ``size``: rank ``index`` of ``count``'s equal part
        (:meth:`Shard.part`, whose ValueError it raises when ``count`` does not divide ``size``)."""
        start, piece = Shard(self.index, self.count).part(size, f"dim {self.dim}")
        return start, start + piece


class CheckpointError(ValueError):
    """A checkpoint that does not match what the model expects (missing, misshapen or unused tensors)."""


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory, as a dict (the providers' typed configs come from it)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: expected a Hugging Face model directory")
    return json.loads(file.read_text())


def generation_eos_ids(path: str | Path) -> tuple[int, ...]:
    """The ``eos_token_id`` of a model directory's ``generation_config.json`` (an int or a list, as
    published), as a tuple; () when the file or the entry is absent."""
    file = Path(path) / "generation_config.json"
    eos = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def resolve_dtype(dtype: torch.dtype | str | None, config: dict[str, Any]) -> torch.dtype:
    """``dtype`` if given, else the config's ``dtype``/``torch_dtype``, else float32 (bf16/fp16/fp32 only)."""
    if dtype is None:
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (expected one of {sorted(DTYPES)})")
        dtype = DTYPES[dtype.removeprefix("torch.")]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype} is not supported (expected one of {sorted(DTYPES)})")
    return dtype


class WeightReader:
    """Lazy reader over a checkpoint directory's tensors: ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``, else ``pytorch_model.bin`` or ``pytorch_model.bin.index.json``.

    ``take(key, shape)`` returns a tensor converted to the reader's ``dtype`` on its ``device``
    (an FP8 weight dequantized with its ``weight_scale_inv``) and records the key as used;
    :meth:`finish` then names every tensor nobody took. The directory's quantization is read from
    its ``config.json`` (``quantization_config``) or AutoGPTQ's ``quantize_config.json``, and anything
    but :data:`tandem.models.fp8.SUPPORTED` raises ValueError here, before a tensor is read.
    """

    def __init__(self, path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.path = Path(path)
        self.dtype, self.device = dtype, torch.device(device)
        self.block = fp8.block_size(*_quantization(self.path))  # FP8 block (rows, columns); None: unquantized
        self._handles: dict[Path, Any] = {}
        self._used: set[str] = set()
        for index, single in CHECKPOINT_FILES:
            if (self.path / index).is_file():
                weight_map = json.loads((self.path / index).read_text())["weight_map"]
                self._shard_of = {key: self.path / shard for key, shard in weight_map.items()}
                break
            if (self.path / single).is_file():
                self._shard_of = dict.fromkeys(self._handle(self.path / single).keys(), self.path / single)
                break
        else:
            raise FileNotFoundError(
                f"{self.path}: neither model.safetensors nor model.safetensors.index.json "
                "(nor pytorch_model.bin or pytorch_model.bin.index.json)"
            )

    def keys(self) -> list[str]:
        return sorted(self._shard_of)

    def __contains__(self, key: str) -> bool:
        return key in self._shard_of

    def _open(self, key: str):
        shard = self._shard_of[key]
        if shard not in self._handles and not shard.is_file():
            raise CheckpointError(f"{self.path}: shard {shard.name} (holding {key!r}) is missing")
        return self._handle(shard)

    def _handle(self, shard: Path):
        """The open reader of ``shard`` (safetensors' lazy one, or a whole ``.bin`` file), opened once."""
        if shard not in self._handles:
            is_bin = shard.suffix == ".bin"
            self._handles[shard] = _TorchShard(shard) if is_bin else safe_open(shard, framework="pt", device="cpu")
        return self._handles[shard]

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key`` (reads no data)."""
        self._require(key, None)
        handle = self._open(key)
        if isinstance(handle, _TorchShard):
            return tuple(handle.tensors[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def _require(self, key: str, shape: tuple[int, ...] | None) -> None:
        if key not in self._shard_of:
            close = difflib.get_close_matches(key, self._shard_of, n=3, cutoff=0.6)
            hint = f"; similar keys: {close}" if close else ""
            raise CheckpointError(f"{self.path}: missing tensor {key!r} (expected shape {shape}){hint}")

    def take(
        self,
        key: str,
        shape: tuple[int, ...] | None = None,
        *,
        dtype: torch.dtype | None = None,
        part: Part | None = None,
    ) -> Tensor:
        """Tensor ``key`` (only its ``part`` when given: a rank's piece, the only bytes read) checked against
        ``shape`` (None: any; a part's shape when ``part`` is given), as ``dtype`` (default: the reader's).

        Raises :class:`CheckpointError` naming the key, the expected and the found shape.
        """
        self._require(key, shape)
        handle = self._open(key)
        stored = self.shape(key)
        bounds = None if part is None else self._part_bounds(key, stored, part)
        found = stored if bounds is None else stored[: part.dim] + (bounds[1] - bounds[0],) + stored[part.dim + 1 :]
        if shape is not None and tuple(found) != tuple(shape):
            what = "has shape" if part is None else f"(stored {stored}) has a part {part} of shape"
            raise CheckpointError(f"{self.path}: tensor {key!r} {what} {tuple(found)}, expected {tuple(shape)}")
        scale_key = key + fp8.SCALE_SUFFIX
        if scale_key in self._shard_of:
            tensor = self._dequantized(key, scale_key, dtype or self.dtype, part, bounds)
        else:
            tensor = _read(handle, key, None if part is None else (part.dim, *bounds))
            if not (tensor.is_floating_point() or dtype is not None):
                raise CheckpointError(f"{self.path}: tensor {key!r} has dtype {tensor.dtype}, expected a float tensor")
            if tensor.dtype.itemsize == 1 and tensor.is_floating_point():
                raise CheckpointError(
                    f"{self.path}: tensor {key!r} is {tensor.dtype}: dequantize the checkpoint first "
                    f"(tandem reads FP8 weights with their {scale_key!r} under an fp8 quantization_config)"
                )
        self._used.add(key)
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def _part_bounds(self, key: str, stored: tuple[int, ...], part: Part) -> tuple[int, int]:
        if not 0 <= part.dim < len(stored) or not 0 <= part.index < part.count:
            raise CheckpointError(f"{self.path}: tensor {key!r} {stored} has no part {part}")
        try:
            return part.bounds(stored[part.dim])
        except ValueError as error:
            raise CheckpointError(f"{self.path}: tensor {key!r} {stored} along {error}") from None

    def _dequantized(
        self, key: str, scale_key: str, dtype: torch.dtype, part: Part | None, bounds: tuple[int, int] | None
    ) -> Tensor:
        """FP8 tensor ``key`` (its ``part``, within ``bounds``) times its block scales (tensor ``scale_key``, then
        counted as used), in ``dtype`` on the reader's device. A part reads only the scale blocks it overlaps and
        their weight rows or columns, and cuts the piece from them after dequantizing."""
        if self.block is None:
            raise CheckpointError(
                f"{self.path}: tensor {scale_key!r} is a block scale, but config.json has no fp8 quantization_config"
            )
        stored = self.shape(key)
        weight_handle, scale_handle = self._open(key), self._open(scale_key)
        expected = fp8.scale_shape(stored, self.block) if len(stored) == 2 else None
        if (scale_shape := self.shape(scale_key)) != expected:
            raise CheckpointError(
                f"{self.path}: tensor {scale_key!r} has shape {scale_shape}, "
                f"expected {expected} (blocks of {self.block} over {key!r} {stored})"
            )
        cut = None
        if part is None:
            weight, scale = weight_handle.get_tensor(key), scale_handle.get_tensor(scale_key)
        else:  # whole blocks around the piece, then the piece
            size = self.block[part.dim]
            first, last = bounds[0] // size, -(-bounds[1] // size)
            weight = _read(weight_handle, key, (part.dim, first * size, min(last * size, stored[part.dim])))
            scale = _read(scale_handle, scale_key, (part.dim, first, last))
            cut = (bounds[0] - first * size, bounds[1] - first * size)
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise CheckpointError(
                f"{self.path}: tensor {key!r} is {weight.dtype} {stored}: expected a 2-D float8_e4m3fn "
                f"weight beside {scale_key!r}"
            )
        self._used.add(scale_key)
        tensor = fp8.dequantize(weight.to(self.device), scale.to(self.device), self.block, dtype)
        return tensor if cut is None else tensor.narrow(part.dim, cut[0], cut[1] - cut[0]).contiguous()

    def unused(self, ignore: Iterable[str] = ()) -> list[str]:
        """Keys nobody took, except those matching a regex in ``ignore`` (``re.match``)."""
        patterns = [re.compile(p) for p in ignore]
        return [k for k in self.keys() if k not in self._used and not any(p.match(k) for p in patterns)]

    def finish(self, ignore: Iterable[str] = ()) -> None:
        """Raise :class:`CheckpointError` listing the unused keys (beyond ``ignore``); close the shards."""
        left = self.unused(ignore)
        self._handles.clear()
        if left:
            shown = left[:20] + ([f"... {len(left) - 20} more"] if len(left) > 20 else [])
            raise CheckpointError(f"{self.path}: {len(left)} tensors were not used by the model: {shown}")


def _read(handle, key: str, piece: tuple[int, int, int] | None) -> Tensor:
    """Tensor ``key`` of an open shard, or only ``piece = (dim, start, stop)`` of it (safetensors reads just those
    bytes; a ``.bin`` shard is in memory already)."""
    if piece is None:
        return handle.get_tensor(key)
    dim, start, stop = piece
    if isinstance(handle, _TorchShard):
        return handle.tensors[key].narrow(dim, start, stop - start).contiguous()
    index = (slice(None),) * dim + (slice(start, stop),)
    return handle.get_slice(key)[index]


class _TorchShard:
    """A ``pytorch_model*.bin`` file, read whole by ``torch.load(weights_only=True)`` (which runs no pickled
    code), answering ``keys`` and ``get_tensor`` as a safetensors reader does."""

    def __init__(self, file: Path):
        self.tensors: dict[str, Tensor] = torch.load(file, map_location="cpu", weights_only=True)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, key: str) -> Tensor:
        return self.tensors[key]


def _quantization(path: Path) -> tuple[dict[str, Any] | None, Path]:
    """A checkpoint directory's quantization settings and the file they come from: ``config.json``'s
    ``quantization_config``, else AutoGPTQ's ``quantize_config.json`` (read as gptq when it names no method)."""
    config, gptq = path / "config.json", path / "quantize_config.json"
    settings = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if settings is None and gptq.is_file():
        return {"quant_method": "gptq", **json.loads(gptq.read_text())}, gptq
    return settings, config


Registry = dict[str, tuple[str, type]]  # name -> (provider module, config class)


def _provider(registry: Registry, name: str, what: str, where: Path | str) -> tuple[ModuleType, type]:
    """The provider module registered under ``name`` (imported) and its config class; ``what``/``where``
    go into the error."""
    if name not in registry:
        raise ValueError(f"{where}: unknown {what} {name!r}: supported are {sorted(registry)}")
    module, config_class = registry[name]
    return importlib.import_module(module), config_class


def load_target(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    shard: Shard = SINGLE,
) -> Target:
    """Build the target model of HF directory ``path`` (dispatch on ``config["model_type"]``); with a parallel
    ``shard``, this rank's part of it, read piece by piece."""
    path = Path(path)
    raw = read_config(path)
    module, config_class = _provider(
        TARGET_MODULES, raw.get("model_type", "<none>"), "target model_type", path / "config.json"
    )
    dtype = resolve_dtype(dtype, raw)
    device = torch.device(device or "cpu")
    weights = WeightReader(path, dtype=dtype, device=device)
    target = module.build(config_class.from_dict(raw), weights, dtype=dtype, device=device, shard=shard)
    target.checkpoint_dir = path
    return target


def draft_kind(config: dict[str, Any], weights: WeightReader) -> str:
    """The :data:`DRAFT_MODULES` key of a draft checkpoint.

    Reads ``architectures[0]``; a plain ``LlamaForCausalLM`` (how EAGLE-1 Llama-3 drafts are
    published) is told apart by its ``fc.weight``: ``[H, 2H]`` is EAGLE, ``[H, 3H]`` EAGLE-3.
    """
    arch = (config.get("architectures") or [config.get("model_type", "<none>")])[0]
    if arch in DRAFT_MODULES:
        return arch
    if "fc.weight" in weights:
        out_features, in_features = weights.shape("fc.weight")
        return {2: "LlamaForCausalLMEagle", 3: "LlamaForCausalLMEagle3"}.get(in_features // out_features, arch)
    return arch


def load_draft(
    path_or_kind: str | Path,
    target: Target,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Draft:
    """Build a draft for ``target``: ``"ngram"``, ``"suffix"``, ``"mtp"``, or a draft checkpoint directory.

    ``dtype``/``device`` default to the target's (its first parameter's) when it has any. ``"mtp"``
    reads the target's own checkpoint directory, its ``config.json`` included.
    """
    target_param = next(iter(getattr(target, "parameters", lambda: iter(()))()), None)
    if dtype is None and target_param is not None:
        dtype = target_param.dtype
    device = torch.device(device or (target_param.device if target_param is not None else "cpu"))
    if path_or_kind in ("ngram", "suffix"):  # model-free
        module, config_class = _provider(DRAFT_MODULES, path_or_kind, "draft", path_or_kind)
        return module.build(config_class(), None, dtype=resolve_dtype(dtype, {}), device=device, target=target)
    if path_or_kind == "mtp":
        if target.checkpoint_dir is None:
            raise ValueError("draft 'mtp' reads the target's checkpoint, but this target has no checkpoint_dir")
        path, kind = Path(target.checkpoint_dir), "mtp"
        raw = read_config(path)
        weights = WeightReader(path, dtype=resolve_dtype(dtype, raw), device=device)
    else:
        path = Path(path_or_kind)
        raw = read_config(path)
        weights = WeightReader(path, dtype=resolve_dtype(dtype, raw), device=device)
        kind = draft_kind(raw, weights)
    module, config_class = _provider(DRAFT_MODULES, kind, "draft architecture", path / "config.json")
    return module.build(config_class.from_dict(raw), weights, dtype=weights.dtype, device=device, target=target)


def load_tokenizer(path: str | Path):
    """The tokenizer of HF directory ``path`` via transformers (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


TakeFn = Callable[..., Tensor]  # WeightReader.take: (key, shape, *, dtype, part) -> Tensor


@torch.no_grad()
def load_param(param: Tensor, take: TakeFn, key: str, part: Part | None = None) -> None:
    """Copy checkpoint tensor ``key`` (only its ``part`` when given; shape checked against ``param``) into
    ``param``, in param's dtype."""
    param.copy_(take(key, tuple(param.shape), dtype=param.dtype, part=part))


def checkpoint_tensors(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, Tensor, Part | None]]:
    """Every parameter of ``module`` as ``(checkpoint key, tensor, part)``: ``prefix + name`` and the part of the
    stored tensor it holds (a module's ``checkpoint_parts[name]``: a rank's piece of a parallel weight; None: the
    whole), except that a module with ``part_tensors`` (:class:`~tandem.models.linear.MergedLinear`) yields views
    of its parameters under its parts' keys (next to it, not under it), so loading is one pass over the module."""
    parts = getattr(module, "checkpoint_parts", {})
    for name, param in module.named_parameters(recurse=False):
        yield prefix + name, param, parts.get(name)
    for name, child in module.named_children():
        if hasattr(child, "part_tensors"):
            yield from child.part_tensors(prefix)
        else:
            yield from checkpoint_tensors(child, f"{prefix}{name}.")


def load_module(module: torch.nn.Module, take: TakeFn, prefix: str) -> None:
    """Fill every parameter of ``module`` from its checkpoint key under ``prefix``
    (:func:`checkpoint_tensors`: ``prefix + name``, merged weights by part, a rank's piece of a parallel weight)."""
    for key, tensor, part in checkpoint_tensors(module, prefix):
        load_param(tensor, take, key, part)
