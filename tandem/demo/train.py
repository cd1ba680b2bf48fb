"""Training the demo models shipped in `tandem/assets/` (run by `tandem train-demo`).

Stages, each reproducible from its seed: the tokenizer (`tokenizer/`), then the targets with
transformers' own `LlamaForCausalLM` (`demo-llama/`) and `DeepseekV3ForCausalLM` (`demo-deepseek/`,
MLA + MoE). A target trains on an endless stream of corpus chats with the loss on the assistant
turn only (reasoning, `</think>`, answer, `<|eot_id|>`), then is saved with `save_pretrained`
(safetensors, bf16 when its greedy predictions agree with fp32, else fp32) beside the tokenizer
files and `tandem_demo.json` (corpus seed and settings, losses, held-out check, wall time).
Then the drafts (`tandem.demo.drafts`, batched by the same `batch_rows`): the EAGLE-3 and EAGLE-1
drafts of demo-llama (`demo-llama-eagle3/`, `demo-llama-eagle/`) and the MTP layer of
demo-deepseek (inside its checkpoint).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tandem.demo.corpus import Example, iter_examples
from tandem.demo.evaluate import evaluate_heldout, prompt_text
from tandem.demo.tokenizer import DEFAULT_VOCAB_SIZE, save_tokenizer, train_tokenizer
from tandem.training.data import IGNORE_INDEX, batch_rows
from tandem.training.trainer import LossFn, Trainer, loss_summary

SETTINGS_FILE = "tandem_demo.json"
BF16_MIN_AGREEMENT = 0.99  # greedy teacher-forced agreement bf16 vs fp32 needed to ship bf16

# Model shapes per size. "demo" is what ships; "tiny" is for tests and smoke runs.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "demo": {
        "tokenizer": {"num_examples": 20_000, "vocab_size": DEFAULT_VOCAB_SIZE},
        # narrow and deep: a target many times the cost of its one-layer draft, as real pairs are
        "llama": {
            "hidden_size": 192,
            "intermediate_size": 576,
            "num_hidden_layers": 16,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
        },
        "deepseek": {
            "hidden_size": 192,
            "intermediate_size": 576,
            "moe_intermediate_size": 96,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "q_lora_rank": 128,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 2,
        },
    },
    "tiny": {
        "tokenizer": {"num_examples": 1_000, "vocab_size": 512},
        "llama": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "deepseek": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 8,
            "n_routed_experts": 4,
            "n_group": 2,
            "topk_group": 1,
            "num_experts_per_tok": 2,
        },
    },
}
TARGETS = {"llama": "demo-llama", "deepseek": "demo-deepseek"}
DRAFTS = ("eagle3", "eagle", "mtp")  # trained after the targets (tandem.demo.drafts)
# what the shipped models trained for
DEFAULT_STEPS = {"llama": 2800, "deepseek": 1000, "eagle3": 1000, "eagle": 1000, "mtp": 1000}


@dataclass
class TrainSettings:
    """Everything that decides a trained target, saved into its directory."""

    steps: int
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0  # model init and corpus stream (split "train"); held-out check uses split "heldout"
    size: str = "demo"
    eval_examples: int = 30


def target_config(kind: str, tokenizer: PreTrainedTokenizerBase, size: str = "demo") -> PretrainedConfig:
    """The HF config of the demo target `kind` ("llama" | "deepseek"), with the tokenizer's special ids."""
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }
    if kind == "llama":  # Llama 3.1's RoPE (theta 500000, llama3 scaling by 8), at 1/8 of its context
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        return LlamaConfig(
            **SIZES[size]["llama"], **ids, max_position_embeddings=8192, rope_parameters=rope, rms_norm_eps=1e-5
        )
    if kind == "deepseek":  # first layer dense, then MoE: routed experts in groups + 1 shared expert
        return DeepseekV3Config(
            **SIZES[size]["deepseek"],
            **ids,
            max_position_embeddings=4096,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_nextn_predict_layers=0,
        )
    raise ValueError(f"unknown target {kind!r}; expected one of {sorted(TARGETS)}")


def encode_chat(tokenizer: PreTrainedTokenizerBase, example: Example) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one chat: prompt tokens (up to `<think>\\n`) get IGNORE_INDEX labels.

    Prompt and completion are encoded separately, exactly as generation sees them.
    """
    prompt = prompt_text(tokenizer, example)
    full = tokenizer.apply_chat_template(example.chat(), tools=example.tools, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    completion_ids = tokenizer.encode(full[len(prompt) :], add_special_tokens=False)
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def iter_batches(
    tokenizer: PreTrainedTokenizerBase, batch_size: int, seed: int, split: str = "train", bucket: int = 8
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless right-padded batches of corpus chats (`batch_rows` of `encode_chat`)."""
    rows = (encode_chat(tokenizer, example) for example in iter_examples(seed, split))
    return batch_rows(rows, tokenizer.pad_token_id, batch_size, seed, bucket)


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """The HF model's own next-token loss on `batch` (labels included); no per-depth agreement."""
    return model(**batch).loss, []


def train_model(
    model: torch.nn.Module,
    batches: Iterator[dict[str, torch.Tensor]],
    settings: TrainSettings,
    desc: str,
    loss_fn: LossFn = causal_lm_loss,
) -> list[float]:
    """`settings.steps` steps of :class:`tandem.training.trainer.Trainer` on the parameters that require
    grad; returns the loss of every step."""
    trainer = Trainer(model, settings)
    trainer.run(lambda _: next(batches), loss_fn, desc)
    return trainer.losses


@torch.no_grad()
def bf16_agreement(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> float:
    """Fraction of assistant positions whose argmax is the same with bf16-rounded weights as in fp32."""
    reference = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    rounded = {name: p.to(torch.bfloat16).float() for name, p in model.state_dict().items()}
    original = {name: p.clone() for name, p in model.state_dict().items()}
    model.load_state_dict(rounded)
    candidate = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    model.load_state_dict(original)
    scored = batch["labels"] != IGNORE_INDEX
    return (reference == candidate)[scored].float().mean().item()


def train_target(
    kind: str, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path, settings: TrainSettings
) -> dict[str, Any]:
    """Train one demo target and write its HF directory; returns the record saved as tandem_demo.json."""
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    config = target_config(kind, tokenizer, settings.size)
    model = (LlamaForCausalLM if kind == "llama" else DeepseekV3ForCausalLM)(config)
    losses = train_model(
        model, iter_batches(tokenizer, settings.batch_size, settings.seed), settings, desc=f"train {TARGETS[kind]}"
    )
    agreement = bf16_agreement(model, next(iter_batches(tokenizer, 16, settings.seed, split="heldout")))
    dtype = torch.bfloat16 if agreement >= BF16_MIN_AGREEMENT else torch.float32
    model.load_state_dict({name: p.to(dtype).float() for name, p in model.state_dict().items()})
    report = evaluate_heldout(model, tokenizer, settings.eval_examples, seed=settings.seed)

    out_dir = Path(out_dir)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(dtype).save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir)
    record = {
        "target": TARGETS[kind],
        "corpus": {"seed": settings.seed, "split": "train", "families": "all"},
        "training": asdict(settings),
        "dtype": str(dtype).removeprefix("torch."),
        "bf16_argmax_agreement": round(agreement, 4),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        **loss_summary(losses),
        "loss_every_25_steps": [round(loss, 4) for loss in losses[::25]],
        "heldout": asdict(report),
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    (out_dir / SETTINGS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def load_or_train_tokenizer(out_dir: Path, size: str, retrain: bool) -> PreTrainedTokenizerBase:
    """The tokenizer in `out_dir/tokenizer`, trained (seed 0) and saved there first if missing or `retrain`."""
    directory = out_dir / "tokenizer"
    if retrain or not (directory / "tokenizer.json").is_file():
        settings = SIZES[size]["tokenizer"]
        save_tokenizer(train_tokenizer(seed=0, **settings), directory)
        (directory / SETTINGS_FILE).write_text(
            json.dumps({"corpus": {"seed": 0, "split": "train"}, **settings}, indent=2) + "\n"
        )
    return AutoTokenizer.from_pretrained(directory)
