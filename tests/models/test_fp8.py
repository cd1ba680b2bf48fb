"""FP8 block-quantized checkpoints (DeepSeek-V3's published layout): the demo DeepSeek checkpoint, MTP
layer included, quantized here into that layout, loads as exactly the model its dequantized weights
make (logits within 1e-5, expected equal; greedy tokens equal, plain and with the MTP draft), and
quantization tandem cannot read is refused by name."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.assets import ASSETS_DIR
from tandem.models import CheckpointError, ForwardBatch, load_target
from tandem.models.loading import WeightReader

BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
UNQUANTIZED = re.compile(r".*(embed_tokens|lm_head|shared_head\.head|mlp\.gate)\.weight$")  # as published
LOGIT_TOL = 1e-5  # both load the same float32 products: expected 0
PROMPTS = ["Classify the sentiment of this review: the kettle broke in a week.", "What is 12 plus 30?"]


def blocks(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``scale [ceil(out/128), ceil(in/128)]`` repeated over its blocks and cut to ``shape`` (edges partial)."""
    return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: shape[0], : shape[1]]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block: scale = amax / 448 (e4m3's largest), ``weight / scale`` in float8_e4m3fn."""
    rows, cols = -(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[: weight.shape[0], : weight.shape[1]] = weight.float().abs()
    scale = padded.view(rows, BLOCK, cols, BLOCK).amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    return (weight.float() / blocks(scale, weight.shape)).to(torch.float8_e4m3fn), scale


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the demo DeepSeek quantized to FP8, the same weights dequantized in float32), tokenizer files beside."""
    source = ASSETS_DIR / "demo-deepseek"
    fp8_dir, dequantized_dir = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("dequantized")
    for directory in (fp8_dir, dequantized_dir):
        shutil.copytree(source, directory, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    quantized, dequantized = {}, {}
    for key, tensor in load_file(source / "model.safetensors").items():
        if tensor.dim() == 2 and not UNQUANTIZED.match(key):
            weight, scale = quantize(tensor)
            quantized |= {key: weight, key + "_scale_inv": scale}
            dequantized[key] = weight.float() * blocks(scale, weight.shape)
        else:
            quantized[key] = dequantized[key] = tensor
    assert any(key.startswith("model.layers.8.") and key.endswith("_scale_inv") for key in quantized)  # MTP layer
    config = json.loads((source / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    save_file(quantized, fp8_dir / "model.safetensors")
    save_file({k: v.float().contiguous() for k, v in dequantized.items()}, dequantized_dir / "model.safetensors")
    return fp8_dir, dequantized_dir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_checkpoint_logits_equal_its_dequantized_weights(checkpoints, dtype):
    fp8_dir, dequantized_dir = checkpoints
    rows = [[5, 17, 300, 41, 9, 1000], [2, 3]]
    batch = ForwardBatch.from_rows(rows, [0, 0], [0, 1])
    logits = []
    for path in (fp8_dir, dequantized_dir):
        target = load_target(path, dtype=dtype)
        assert target.layers[1].self_attn.o_proj.weight.dtype == dtype
        logits.append(target.forward(batch, target.new_cache(2, 16)).logits)
    assert (logits[0] - logits[1]).abs().max().item() <= LOGIT_TOL
    original = load_target(ASSETS_DIR / "demo-deepseek", dtype=dtype)
    quantization_error = (original.forward(batch, original.new_cache(2, 16)).logits - logits[0]).abs().max().item()
    assert quantization_error > LOGIT_TOL  # the weights were quantized: the comparison above can fail


@pytest.mark.parametrize("draft", [None, "mtp"])
def test_fp8_checkpoint_greedy_outputs_equal_the_dequantized_ones(checkpoints, draft):
    from tandem import LLM, SamplingParams

    params = SamplingParams(max_tokens=24)
    outputs = [
        [out.token_ids for out in LLM(str(path), draft, num_speculative_tokens=3).generate(PROMPTS, params)]
        for path in checkpoints
    ]
    assert outputs[0] == outputs[1]
    assert all(len(ids) > 0 for ids in outputs[0])


def test_block_scales_count_as_read_and_a_misshapen_one_is_named(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints
    reader = WeightReader(fp8_dir)
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [80, 192]: partial blocks both ways
    assert reader.shape(key + "_scale_inv") == (1, 2)
    reader.take(key, (80, 192))
    assert key + "_scale_inv" not in reader.unused()
    shutil.copy(fp8_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(fp8_dir / "model.safetensors")
    save_file({key: tensors[key], key + "_scale_inv": torch.ones(2, 2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'.*kv_a_proj_with_mqa.weight_scale_inv' has shape \(2, 2\), expected"):
        WeightReader(tmp_path).take(key)


@pytest.mark.parametrize(
    "quantization, says",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({**FP8_CONFIG, "weight_block_size": [64, 64]}, r"fp8 quantization_config weight_block_size=\[64, 64\]"),
        ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme='static' is not supported"),
        ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt='e5m2' is not supported"),
    ],
)
def test_unreadable_quantization_is_refused_naming_method_and_file(checkpoints, tmp_path, quantization, says):
    fp8_dir, _ = checkpoints
    shutil.copytree(fp8_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((fp8_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / 'config.json'))}: .*{says}"):
        load_target(tmp_path)


def test_autogptq_quantize_config_is_refused(tmp_path):
    shutil.copytree(ASSETS_DIR / "demo-deepseek", tmp_path, dirs_exist_ok=True)
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(ValueError, match=r"quantize_config.json: quantization_config quant_method 'gptq'"):
        load_target(tmp_path)


def test_block_scales_without_an_fp8_config_are_refused(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints
    shutil.copytree(fp8_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is a block scale, but config.json has no fp8 quantization_config"):
        load_target(tmp_path)
