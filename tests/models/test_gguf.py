"""GGUF files (tandem.models.gguf): written from the demo Llama as llama.cpp's converter writes them, read back.

F16 holds the demo's bfloat16 weights exactly (bar float16 subnormals), so the converted model must generate
token for token what the source generates. Q8_0 rounds every weight to 8 bits per block of 32: its logits must
stay within Q8_0_TOLERANCE of the source's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.assets import ASSETS_DIR
from tandem.cli import main as cli_main
from tandem.demo.corpus import generate_examples
from tandem.llm import chat_prompt_ids
from tandem.models import ForwardBatch, WeightReader, load_target
from tandem.models import gguf as gguf_module
from tandem.models.gguf import convert_gguf, gguf_directory, llama3_rope_parameters

DEMO = ASSETS_DIR / "demo-llama"
EXAMPLES = generate_examples(3, seed=5, split="heldout")
# Q8_0 vs the bfloat16 source over the prefill positions of three held-out chat prompts: KL(source || Q8_0) per
# position, |p - p'| per token, mean |logit - logit'|. A Q/K permutation left in place lands far outside.
Q8_0_TOLERANCE = {"kl_max": 0.02, "prob_diff_max": 0.06, "logit_diff_mean": 0.1}
TEXTS = [
    "Hello world!",
    "  two  spaces\n\nnew lines\tand a tab",
    '<think>\nthe reasoning</think>{"answer": 42}',
    "héllo wörld 日本語 🚀 1234567",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
]


# ---------------------------------------------------------------- writing GGUF files as convert_hf_to_gguf.py does
def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved, for its RoPE kernel."""
    if n_head_kv != n_head:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's ``generate_extra_tensors`` computes it for llama3 RoPE scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    divisors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_gguf(model_dir: Path, path: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """Write HF directory ``model_dir`` as llama.cpp's ``convert_hf_to_gguf.py --outtype`` f16 / q8_0 / f32 would:
    its metadata keys, ``gpt2`` tokenizer and ``gguf.SpecialVocab``, permuted Q/K, 1-D tensors in F32."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    rope = config["rope_parameters"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(model_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    file_types = {"F16": "MOSTLY_F16", "Q8_0": "MOSTLY_Q8_0", "F32": "ALL_F32"}
    writer.add_file_type(gguf.LlamaFileType[file_types[qtype.name]])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    by_id, added = {i: t for t, i in tokenizer.get_vocab().items()}, tokenizer.get_added_vocab()
    tokens = [by_id[i] for i in range(config["vocab_size"])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")  # the demo splits text with Llama 3's pattern
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for key, tensor in load_file(model_dir / "model.safetensors").items():
        tensor = tensor.float()
        if ".q_proj." in key:
            tensor = llama_cpp_permute(tensor, heads, heads)
        elif ".k_proj." in key:
            tensor = llama_cpp_permute(tensor, heads, kv_heads)
        stem, suffix = key.rsplit(".", 1)
        name, values = f"{names.get_name(stem)}.{suffix}", tensor.numpy()
        if values.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            blocks = gguf.quants.quantize(values, qtype)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_bare_gguf(path: Path, architecture: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]):
    """A GGUF with nothing but ``general.architecture`` and ``tensors`` (name -> (data, type))."""
    writer = gguf.GGUFWriter(path, architecture)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The demo Llama as F16 and Q8_0 GGUF files."""
    root = tmp_path_factory.mktemp("gguf")
    return {
        name: write_gguf(DEMO, root / f"demo-llama-{name}.gguf", gguf.GGMLQuantizationType[name])
        for name in ("F16", "Q8_0")
    }


@pytest.fixture(scope="module")
def converted(files, tmp_path_factory) -> dict[str, Path]:
    """Their directories, converted into a cache of the module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_GGUF_CACHE", str(tmp_path_factory.mktemp("gguf-cache")))
        return {name: gguf_directory(file) for name, file in files.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, save_llama):
    """``(transformers model, F32 GGUF file)`` of a tiny Llama with tied embeddings, attention biases and
    default RoPE (and the demo's tokenizer): what the demo does not cover, and quick to convert."""
    source = tmp_path_factory.mktemp("tiny")
    model = save_llama(
        source,
        vocab_size=2048,  # the demo tokenizer's
        tie_word_embeddings=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, source / name)
    return model, write_gguf(source, source.parent / "tiny.gguf", gguf.GGMLQuantizationType.F32)


@pytest.fixture(scope="module")
def source_outputs():
    """The demo Llama's greedy outputs on the held-out prompts."""
    return LLM("demo-llama", max_num_seqs=len(EXAMPLES)).generate(prompts(), SamplingParams(max_tokens=40))


def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    return [chat_prompt_ids(tokenizer, example.messages, example.tools) for example in EXAMPLES]


def prefill_logits(target, rows: list[list[int]]) -> torch.Tensor:
    cache = target.new_cache(num_slots=len(rows), max_len=max(map(len, rows)) + 1)
    return target.forward(ForwardBatch.from_rows(rows, [0] * len(rows), list(range(len(rows)))), cache).logits


# ---------------------------------------------------------------- the round trip
@pytest.mark.parametrize("draft", [None, "ngram"])
def test_llm_on_the_f16_gguf_generates_token_for_token_what_the_source_generates(
    files, converted, source_outputs, draft, monkeypatch
):
    monkeypatch.setenv("TANDEM_GGUF_CACHE", str(converted["F16"].parent))
    llm = LLM(str(files["F16"]), draft, max_num_seqs=len(EXAMPLES))
    assert llm.model_path == converted["F16"]  # through the cache: converted once
    outputs = llm.generate(prompts(), SamplingParams(max_tokens=40))
    assert [out.token_ids for out in outputs] == [out.token_ids for out in source_outputs]
    assert sum(len(out.token_ids) for out in source_outputs) > 3 * 10, "outputs too short to compare"


def test_q8_0_logits_stay_within_the_stated_tolerance_of_the_source(converted):
    rows = [ids[:64] for ids in prompts()]
    source = prefill_logits(load_target(DEMO, dtype=torch.float32), rows)
    quantized = prefill_logits(load_target(converted["Q8_0"], dtype=torch.float32), rows)
    kl = torch.nn.functional.kl_div(
        quantized.log_softmax(-1), source.log_softmax(-1), log_target=True, reduction="none"
    )
    assert kl.sum(-1).max().item() <= Q8_0_TOLERANCE["kl_max"]
    assert (quantized.softmax(-1) - source.softmax(-1)).abs().max().item() <= Q8_0_TOLERANCE["prob_diff_max"]
    assert (quantized - source).abs().mean().item() <= Q8_0_TOLERANCE["logit_diff_mean"]
    assert (quantized - source).abs().max().item() > 0, "Q8_0 rounds the weights: identical logits mean no Q8_0"


def test_tokenizer_encodes_and_decodes_like_the_source_and_keeps_the_chat_template(converted):
    from transformers import AutoTokenizer

    source, loaded = AutoTokenizer.from_pretrained(DEMO), AutoTokenizer.from_pretrained(converted["F16"])
    assert len(loaded) == len(source)
    for text in TEXTS:
        for special in (False, True):
            ids = source(text, add_special_tokens=special)["input_ids"]
            assert loaded(text, add_special_tokens=special)["input_ids"] == ids, (text, special)
            assert loaded.decode(ids) == source.decode(ids)
            assert loaded.decode(ids, skip_special_tokens=True) == source.decode(ids, skip_special_tokens=True)
    config = json.loads((converted["F16"] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == source.chat_template
    for example in EXAMPLES:
        assert chat_prompt_ids(loaded, example.messages, example.tools) == chat_prompt_ids(
            source, example.messages, example.tools
        )


def test_config_and_generation_config_carry_the_source_settings(converted):
    source = json.loads((DEMO / "config.json").read_text())
    for name, dtype in (("F16", "float16"), ("Q8_0", "bfloat16")):
        config = json.loads((converted[name] / "config.json").read_text())
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_parameters",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        ):
            assert config[key] == source[key], key
        assert config["dtype"] == dtype
    generation = json.loads((converted["F16"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [source["eos_token_id"]]
    assert generation["bos_token_id"] == source["bos_token_id"]


def test_a_tied_llama_with_attention_biases_matches_transformers(tiny, tmp_path):
    reference, file = tiny
    out = convert_gguf(file, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["attention_bias"] and config["dtype"] == "float32"
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    ids = torch.randint(2048, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    logits = prefill_logits(load_target(out), ids.tolist())
    assert (logits - expected).abs().max().item() <= 1e-4


# ---------------------------------------------------------------- the command, the cache, shards
def test_convert_gguf_command_writes_the_dtype_asked_for(tiny, tmp_path, capsys):
    _, file = tiny
    out = tmp_path / "bf16"
    assert cli_main(["convert-gguf", str(file), str(out), "--dtype", "bfloat16"]) == 0
    assert str(out) in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    exact = WeightReader(convert_gguf(file, tmp_path / "f32"))  # the F32 file's own dtype by default
    for key, reader in [(key, WeightReader(out)) for key in exact.keys()]:
        assert torch.equal(reader.take(key, dtype=None), exact.take(key, dtype=None).bfloat16()), key
    load_target(out)
    with pytest.raises(SystemExit) as refused:  # OUT_DIR is no longer empty
        cli_main(["convert-gguf", str(file), str(out)])
    assert refused.value.code == 2 and "not an empty directory" in capsys.readouterr().err


def test_gguf_directory_converts_once_per_version_of_a_file(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_GGUF_CACHE", str(tmp_path / "cache"))
    file = shutil.copy(tiny[1], tmp_path / "model.gguf")
    calls = []
    convert = gguf_module.convert_gguf
    monkeypatch.setattr(gguf_module, "convert_gguf", lambda *a, **k: calls.append(a) or convert(*a, **k))
    first = gguf_directory(file)
    assert gguf_directory(file) == first and len(calls) == 1
    assert first.parent == tmp_path / "cache" and (first / "config.json").is_file()
    os.utime(file, ns=(0, 10**9))  # an edited file is another version
    second = gguf_directory(file)
    assert second != first and len(calls) == 2
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, second.name])


def test_sharded_conversion_holds_the_same_weights(tiny, tmp_path):
    _, file = tiny
    out = convert_gguf(file, tmp_path / "sharded", max_shard_bytes=256 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (out / "model.safetensors").exists()
    single, sharded = WeightReader(convert_gguf(file, tmp_path / "single")), WeightReader(out)
    assert sharded.keys() == single.keys()
    for key in single.keys():
        assert torch.equal(sharded.take(key, dtype=None), single.take(key, dtype=None)), key


# ---------------------------------------------------------------- Llama 3.1 RoPE scaling from rope_freqs.weight
@pytest.mark.parametrize(
    "head_dim, theta, factor, original",
    [
        (128, 500000.0, 8.0, 8192),  # Llama 3.1 8B / 70B
        (64, 500000.0, 32.0, 8192),  # Llama 3.2 1B
        (32, 500000.0, 8.0, 1024),  # the demo: two frequencies in the blended band
        (16, 10000.0, 8.0, 32),  # one frequency in the band
        (8, 10000.0, 8.0, 400),  # none: any length between the plateaus gives the same frequencies
    ],
)
def test_llama3_rope_parameters_reproduce_llama_cpp_rope_freqs(head_dim, theta, factor, original):
    from tandem.models.config import RopeParameters
    from tandem.models.rope import rope_inv_freq

    rope = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    divisors = llama_cpp_rope_freqs(rope, head_dim)
    params = llama3_rope_parameters(divisors, theta, head_dim)
    expected = rope_inv_freq(RopeParameters.from_dict({"rope_parameters": rope}), head_dim)
    assert torch.allclose(rope_inv_freq(RopeParameters.from_dict({"rope_parameters": params}), head_dim), expected)
    if head_dim >= 16:
        assert params == rope


def test_rope_freqs_that_are_not_llama3_scaling_are_refused():
    divisors = np.array([1.0, 1.5, 1.2, 3.0, 8.0, 8.0, 2.0, 8.0], dtype=np.float32)
    with pytest.raises(ValueError, match="does not follow Llama 3.1 RoPE scaling"):
        llama3_rope_parameters(divisors, 10000.0, 16)


# ---------------------------------------------------------------- refusals
def test_a_non_llama_architecture_is_refused_by_name(tmp_path):
    file = write_bare_gguf(
        tmp_path / "qwen.gguf",
        "qwen2",
        {"token_embd.weight": (np.zeros((4, 32), np.float32), gguf.GGMLQuantizationType.F32)},
    )
    with pytest.raises(ValueError, match="architecture 'qwen2' is not supported"):
        convert_gguf(file, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_type_gguf_cannot_dequantize_is_refused_naming_type_and_tensor(tmp_path):
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    blocks = np.zeros((4, gguf.GGML_QUANT_SIZES[q8_1][1]), np.uint8)  # 4 rows of one 32-value block
    file = write_bare_gguf(
        tmp_path / "q8_1.gguf",
        "llama",
        {
            "token_embd.weight": (np.zeros((4, 32), np.float32), gguf.GGMLQuantizationType.F32),
            "blk.0.attn_q.weight": (blocks, q8_1),
        },
    )
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_q\.weight' is Q8_1, which the gguf package cannot"):
        convert_gguf(file, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"PK\x03\x04 not a GGUF at all" * 4)
    with pytest.raises(ValueError, match=r"model\.gguf: not a readable GGUF file"):
        convert_gguf(file, tmp_path / "out")
