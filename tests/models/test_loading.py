"""Checkpoint loading: registry dispatch, the weight reader's errors, dtypes, tokenizers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.models import CheckpointError, WeightReader, load_draft, load_target, load_tokenizer
from tandem.models.loading import resolve_dtype


def rewrite_weights(path, edit) -> None:
    """Apply ``edit(tensors: dict)`` to ``path/model.safetensors`` in place."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(llama_dir, path)
    return path


def test_misshapen_tensor_error_names_the_key_and_both_shapes(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(64, 64\), "
        r"expected \(32, 64\)",
    ):
        load_target(llama_copy)


def test_missing_tensor_error_names_the_key_and_similar_ones(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.__setitem__("model.norm.weightt", t.pop("model.norm.weight")))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'model\.norm\.weight' \(expected shape \(64,\)\); "
        r"similar keys: \['model\.norm\.weightt'",
    ):
        load_target(llama_copy)


def test_unused_tensors_are_listed(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.update({"model.layers.9.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"1 tensors were not used by the model: \['model\.layers\.9\.mlp"):
        load_target(llama_copy)


def test_sharded_reader_reports_a_missing_shard(tmp_path, save_llama):
    save_llama(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard}"):
        load_target(tmp_path)


def test_unknown_model_type_and_draft_kind_fail_clearly(llama_copy, llama_dir):
    config = json.loads((llama_copy / "config.json").read_text())
    (llama_copy / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(
        ValueError,
        match=r"config\.json: unknown target model_type 'gpt_neox': supported are \['deepseek_v3', 'llama'\]",
    ):
        load_target(llama_copy)
    (llama_copy / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ValueError, match="unknown draft architecture 'GPTNeoXForCausalLM'"):
        load_draft(llama_copy, load_target(llama_dir))


def test_no_checkpoint_files_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        WeightReader(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_target(tmp_path / "nowhere")


def test_dtype_comes_from_the_argument_then_the_config_then_float32():
    assert resolve_dtype(None, {"dtype": "bfloat16"}) is torch.bfloat16
    assert resolve_dtype(None, {"torch_dtype": "float16"}) is torch.float16
    assert resolve_dtype("float32", {"dtype": "bfloat16"}) is torch.float32
    assert resolve_dtype(None, {}) is torch.float32
    with pytest.raises(ValueError, match="dtype 'float8_e4m3fn' is not supported"):
        resolve_dtype("float8_e4m3fn", {})


def test_reader_converts_dtype_and_rejects_fp8(tmp_path):
    save_file(
        {"a": torch.ones(2, dtype=torch.bfloat16), "q": torch.zeros(2).to(torch.float8_e4m3fn)},
        tmp_path / "model.safetensors",
    )
    reader = WeightReader(tmp_path, dtype=torch.float16)
    assert reader.take("a", (2,)).dtype is torch.float16
    with pytest.raises(CheckpointError, match="'q' is torch.float8_e4m3fn: dequantize"):
        reader.take("q", (2,))
    with pytest.raises(CheckpointError, match=r"1 tensors were not used by the model: \['q'\]"):
        reader.finish()


def test_tokenizer_loads_from_the_local_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path)("hello world")["input_ids"] == [1, 2]
