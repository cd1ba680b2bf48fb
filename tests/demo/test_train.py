"""train-demo: batches mask the prompt, the loop learns, and a tiny run writes a loadable HF directory."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM, LlamaForCausalLM

from tandem import cli
from tandem.assets import TOKENIZER_DIR
from tandem.demo.corpus import generate_examples
from tandem.demo.evaluate import split_completion
from tandem.demo.tokenizer import EOT, THINK_CLOSE
from tandem.demo.train import (
    IGNORE_INDEX,
    SETTINGS_FILE,
    TrainSettings,
    encode_chat,
    iter_batches,
    target_config,
    train_model,
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_labels_cover_exactly_the_assistant_turn(tokenizer):
    example = generate_examples(1, seed=4)[0]
    ids, labels = encode_chat(tokenizer, example)
    scored = [token for token, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert scored == labels[len(ids) - len(scored) :], "loss positions must be one suffix"
    assert tokenizer.decode(scored) == f"{example.reasoning}\n{THINK_CLOSE}{example.answer_text}{EOT}"
    assert tokenizer.decode(ids[: len(ids) - len(scored)]).endswith("<think>\n")


def test_batches_are_padded_deterministic_and_masked(tokenizer):
    first, second = iter_batches(tokenizer, 4, seed=1), iter_batches(tokenizer, 4, seed=1)
    for _ in range(3):
        a, b = next(first), next(second)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert a["input_ids"].shape == a["labels"].shape == a["attention_mask"].shape
        pad = a["attention_mask"] == 0
        assert (a["input_ids"][pad] == tokenizer.pad_token_id).all() and (a["labels"][pad] == IGNORE_INDEX).all()
        assert (a["attention_mask"][:, 0] == 1).all()


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_training_loop_lowers_the_loss_on_a_fixed_batch(tokenizer, kind):
    torch.manual_seed(0)
    model_class = LlamaForCausalLM if kind == "llama" else DeepseekV3ForCausalLM
    model = model_class(target_config(kind, tokenizer, "tiny"))
    batch = next(iter_batches(tokenizer, 2, seed=0))
    losses = train_model(
        model, iter(lambda: batch, None), TrainSettings(steps=15, warmup_steps=2, lr=1e-2), desc=f"overfit {kind}"
    )
    assert losses[-1] < 0.7 * losses[0]


def test_deepseek_config_is_mla_and_moe_with_groups_and_a_shared_expert(tokenizer):
    config = target_config("deepseek", tokenizer)
    assert config.kv_lora_rank and config.q_lora_rank and config.first_k_dense_replace == 1
    assert config.n_shared_experts == 1 and config.n_routed_experts % config.n_group == 0
    assert config.num_hidden_layers > config.first_k_dense_replace
    with pytest.raises(ValueError, match="unknown target 'gpt'"):
        target_config("gpt", tokenizer)


def test_split_completion_accepts_only_reasoning_close_json_eot():
    assert split_completion('a b\n</think>{"x": 1}<|eot_id|>') == ("a b\n", {"x": 1})
    assert split_completion('a</think>{"x": 1}') is None  # no EOS
    assert split_completion('a</think>{"x": 1</think><|eot_id|>') is None
    assert split_completion('<think>a</think>{"x": 1}<|eot_id|>') is None
    assert split_completion('a</think>{"x": <|eot_id|>') is None


def test_tiny_train_demo_run_writes_a_loadable_hf_directory(tmp_path):
    argv = [
        "train-demo",
        "--out",
        str(tmp_path),
        "--size",
        "tiny",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--eval-examples",
        "2",
        "--only",
        "llama",
    ]
    assert cli.main(argv) == 0
    directory = tmp_path / "demo-llama"
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == len(tokenizer) == 512
    assert model.config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert (directory / "model.safetensors").is_file() and tokenizer.chat_template
    record = json.loads((directory / SETTINGS_FILE).read_text())
    assert record["training"]["steps"] == 2 and record["corpus"]["seed"] == 0
    assert record["heldout"]["total"] == 2 and len(record["loss_every_25_steps"]) == 1
    assert (tmp_path / "tokenizer" / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
