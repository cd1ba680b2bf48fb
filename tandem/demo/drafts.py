"""Training the shipped demo drafts: EAGLE-3 and EAGLE-1 for demo-llama, the MTP layer of demo-deepseek.

All three turn the pair (target state at p-1, token x_p) into a prediction of x_{p+1} and are
chained k times at inference (`tandem.models.drafts.eagle.propose_chained`). They are trained with
*training-time test* (TTT, EAGLE-3 paper, section 3.2) over `DEPTHS` chained depths: depth 0
reads the target's features, depth d reads the draft's own output of depth d-1 at the previous
position, and every depth attends to exactly what it attends to at inference (`ttt_visibility`).
The loss is the cross-entropy against the frozen target's distribution at the same position
(distillation: acceptance is agreement with the target, not with the corpus), weighted by
`DEPTH_DECAY ** d`, on the assistant turn only. The assistant turns are the target's own greedy
completions of corpus prompts (`self_distilled_rows`): the draft learns what the target says.

The heads are built from transformers' own layers and saved under the published key names, so
what tandem ships is read by the same loaders as real checkpoints (`tandem.models.drafts.eagle3`,
`tandem.models.drafts.eagle`, and `tandem.models.drafts.mtp` from `model.layers.{L}.*` of the target's own
checkpoint, as in DeepSeek-V3).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from tandem.demo.corpus import generate_examples
from tandem.demo.train import (
    IGNORE_INDEX,
    SETTINGS_FILE,
    TrainSettings,
    batch_rows,
    loss_summary,
    summary_window,
    train_model,
)
from tandem.models.base import default_aux_layer_ids

DEPTHS = 4  # chained draft steps trained: the k the demo runs with
DEPTH_DECAY = 0.8  # loss weight of depth d is DEPTH_DECAY ** d (EAGLE-3's choice)
EAGLE3_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # like the published Llama-3.1 EAGLE-3 drafts


def ttt_visibility(num_pairs: int, depth: int) -> Tensor:
    """Which keys each query sees when depths 0..depth run as one concatenated sequence.

    Returns [(depth+1) * P, (depth+1) * P] bool, blocks of P pairs per depth. A depth-d query at
    pair i stands for the d-th chained step after the first i-d+1 pairs were committed: it sees
    the depth-0 keys of pairs 0..i-d and, for 1 <= j <= d, the depth-j key of pair i-d+j (the
    chained steps before it and itself).
    """
    i = torch.arange(num_pairs)
    query, key = i[:, None], i[None, :]
    rows = []
    for query_depth in range(depth + 1):
        blocks = [key <= query - query_depth]
        blocks += [(key == query - query_depth + j) & (j <= query_depth) for j in range(1, depth + 1)]
        rows.append(torch.cat(blocks, dim=1))
    return torch.cat(rows, dim=0)


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """[Q, K] bool -> [1, 1, Q, K] additive attention mask (0 where visible)."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


class SiblingHead(nn.Module):
    """A draft saved as its own directory beside the target (EAGLE-1, EAGLE-3): `config` is what
    it was built from and is saved with it; its weights are every parameter (the embedding and
    any shared head are the target's, the rotary tables are not weights)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config

    def state(self, target: PreTrainedModel) -> dict[str, Tensor]:
        return {name: t for name, t in self.state_dict().items() if not name.startswith("rotary.")}


class Eagle3Head(SiblingHead):
    """EAGLE-3's draft in transformers' layers, keys as published (`fc`, `midlayer.*`, `norm`, `lm_head`;
    full vocabulary: no d2t)."""

    def __init__(self, target: PreTrainedModel, config: LlamaConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.aux_layer_ids = default_aux_layer_ids(target.config.num_hidden_layers)
        self.fc = nn.Linear(len(self.aux_layer_ids) * target.config.hidden_size, hidden, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.midlayer.hidden_norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        attention = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads cat(embedding, hidden): 2H
            setattr(attention, name, nn.Linear(2 * hidden, getattr(attention, name).out_features, bias=False))
        self.midlayer.self_attn = attention
        self.midlayer.post_attention_layernorm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.midlayer.mlp = LlamaMLP(config)
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        with torch.no_grad():  # start from the target's head: the draft predicts the same tokens
            self.norm.weight.copy_(target.model.norm.weight)
            self.lm_head.weight.copy_(target.lm_head.weight)

    def features(self, hidden_states: tuple[Tensor, ...]) -> Tensor:
        """HF hidden_states -> depth-0 hidden [B, T, H]: fc over the three captured layer inputs."""
        return self.fc(torch.cat([hidden_states[i] for i in self.aux_layer_ids], dim=-1))

    def layer(self, embeds: Tensor, hidden: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """[B, N, H] embeddings and hidden inputs -> pre-norm outputs [B, N, H]; the residual is `hidden`."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        hidden = hidden + layer.self_attn(x, rope, mask)[0]
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, g: Tensor, target: PreTrainedModel) -> Tensor:
        return self.lm_head(self.norm(g))


class EagleHead(SiblingHead):
    """EAGLE-1's draft in transformers' layers, keys as published (`fc`, `layers.0.*` without `input_layernorm`)."""

    def __init__(self, target: PreTrainedModel, config: LlamaConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # the fc output enters attention unnormed
        self.layers = nn.ModuleList([layer])
        self.rotary = LlamaRotaryEmbedding(config)

    def features(self, hidden_states: tuple[Tensor, ...]) -> Tensor:
        """HF hidden_states -> depth-0 hidden [B, T, H]: the last layer after the final norm."""
        return hidden_states[-1]

    def layer(self, embeds: Tensor, hidden: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """[B, N, H] embeddings and hidden inputs -> the layer's outputs g [B, N, H] (embedding first)."""
        return self.layers[0](
            self.fc(torch.cat([embeds, hidden], dim=-1)), attention_mask=mask, position_embeddings=rope
        )

    def logits(self, g: Tensor, target: PreTrainedModel) -> Tensor:
        return target.lm_head(g)  # no norm: g feeds the target's head as it is


class MTPHead(nn.Module):
    """DeepSeek-V3's MTP module in transformers' layers; saved as `model.layers.{L}.*` of the target."""

    def __init__(self, target: PreTrainedModel):
        super().__init__()
        config = target.config
        hidden, eps, last = config.hidden_size, config.rms_norm_eps, config.num_hidden_layers
        self.layer_id = last
        self.enorm = DeepseekV3RMSNorm(hidden, eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=last)  # MLA + MoE, like the target's last layer
        self.shared_head_norm = DeepseekV3RMSNorm(hidden, eps)
        with torch.no_grad():  # warm start from the target's last layer and head norm
            self.block.load_state_dict(target.model.layers[last - 1].state_dict())
            self.shared_head_norm.weight.copy_(target.model.norm.weight)
        self.rotary = target.model.rotary_emb

    def features(self, hidden_states: tuple[Tensor, ...]) -> Tensor:
        """HF hidden_states -> depth-0 hidden [B, T, H]: the last layer after the final norm."""
        return hidden_states[-1]

    def layer(self, embeds: Tensor, hidden: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """[B, N, H] embeddings and hidden inputs -> pre-norm outputs g [B, N, H] (embedding first)."""
        fused = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.block(fused, attention_mask=mask, position_embeddings=rope)

    def logits(self, g: Tensor, target: PreTrainedModel) -> Tensor:
        return target.lm_head(self.shared_head_norm(g))

    def state(self, target: PreTrainedModel) -> dict[str, Tensor]:
        """`model.layers.{L}.*` as DeepSeek-V3 stores it, with its duplicated embedding and head."""
        prefix = f"model.layers.{self.layer_id}."
        tensors = {f"{prefix}{name}": t for name, t in _per_expert(self.block.state_dict()).items()}
        tensors.update(
            {
                f"{prefix}enorm.weight": self.enorm.weight,
                f"{prefix}hnorm.weight": self.hnorm.weight,
                f"{prefix}eh_proj.weight": self.eh_proj.weight,
                f"{prefix}shared_head.norm.weight": self.shared_head_norm.weight,
                f"{prefix}shared_head.head.weight": target.lm_head.weight,
                f"{prefix}embed_tokens.weight": target.model.embed_tokens.weight,
            }
        )
        return tensors


def _per_expert(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' fused expert tensors -> the checkpoint's `mlp.experts.{e}.{gate,up,down}_proj.weight`.

    In memory: `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) and `mlp.experts.down_proj [E, H, I]`.
    """
    out = {name: t for name, t in state.items() if not name.startswith("mlp.experts.")}
    gate_up, down = state["mlp.experts.gate_up_proj"], state["mlp.experts.down_proj"]
    gate, up = gate_up.chunk(2, dim=1)
    for e in range(gate_up.shape[0]):
        out |= {
            f"mlp.experts.{e}.gate_proj.weight": gate[e],
            f"mlp.experts.{e}.up_proj.weight": up[e],
            f"mlp.experts.{e}.down_proj.weight": down[e],
        }
    return out


DraftHead = Eagle3Head | EagleHead | MTPHead


def ttt_forward(
    head: DraftHead, target: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, depths: int = DEPTHS
) -> tuple[Tensor, list[Tensor]]:
    """The target's and the draft's next-token log-probs at every pair and depth.

    input_ids, attention_mask: [B, T] (right-padded). Pair i stands for position p = i + 1: its
    inputs are (target state at i, token x_{i+1}), its teacher is the target at i + 1. Returns
    teacher [B, P, V] and, per depth d, the draft's [B, P, V]; a depth-d entry is meaningful
    for pairs i >= d (it needs d earlier pairs).
    """
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        teacher = out.logits[:, 1:].float().log_softmax(-1)  # [B, P, V]
        embeds = target.get_input_embeddings()(input_ids[:, 1:])  # [B, P, H]
    hidden = head.features(out.hidden_states)[:, :-1]  # [B, P, H], depth 0
    num_rows, num_pairs = embeds.shape[:2]
    cos, sin = head.rotary(embeds, torch.arange(1, num_pairs + 1).expand(num_rows, num_pairs))
    inputs, draft = [hidden], []
    for depth in range(depths):
        blocks = depth + 1
        mask = _additive(ttt_visibility(num_pairs, depth), hidden.dtype)
        rope = (cos.repeat(1, blocks, 1), sin.repeat(1, blocks, 1))
        g = head.layer(embeds.repeat(1, blocks, 1), torch.cat(inputs, dim=1), rope, mask)[:, depth * num_pairs :]
        draft.append(head.logits(g, target).float().log_softmax(-1))
        inputs.append(F.pad(g[:, :-1], (0, 0, 1, 0)))  # depth d+1 at pair i reads g at pair i-1
    return teacher, draft


def ttt_loss(head: DraftHead, target: PreTrainedModel, batch: dict[str, Tensor]) -> tuple[Tensor, list[float]]:
    """The TTT distillation loss of an `iter_batches` batch, and the top-1 agreement with the target per depth."""
    teacher, draft = ttt_forward(head, target, batch["input_ids"], batch["attention_mask"])
    scored = F.pad(batch["labels"][:, 2:] != IGNORE_INDEX, (0, 1), value=False)  # x_{p+1} is an assistant token
    loss, agreement = teacher.new_zeros(()), []
    for depth, log_probs in enumerate(draft):
        valid = scored.clone()
        valid[:, :depth] = False
        cross_entropy = -(teacher.exp() * log_probs).sum(-1)
        loss = loss + DEPTH_DECAY**depth * cross_entropy[valid].mean()
        agreement.append((log_probs.argmax(-1) == teacher.argmax(-1))[valid].float().mean().item())
    return loss, agreement


def one_layer_config(target: PreTrainedModel, architecture: str, **fields: Any) -> LlamaConfig:
    """A draft's config: one Llama layer of the target's shape, plus the draft kind's own `fields`."""
    t = target.config
    config = LlamaConfig(
        architectures=[architecture],
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        vocab_size=t.vocab_size,
        rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings,
        bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id,
        **fields,
    )
    config._attn_implementation = "sdpa"  # the TTT mask is a 4-D additive mask: any dense kernel takes it
    return config


def eagle3_config(target: PreTrainedModel) -> LlamaConfig:
    """EAGLE-3's config: its own RoPE, the full vocabulary as draft vocabulary, the capture points."""
    aux = default_aux_layer_ids(target.config.num_hidden_layers)
    return one_layer_config(
        target,
        "LlamaForCausalLMEagle3",
        rope_parameters=dict(EAGLE3_ROPE),
        draft_vocab_size=target.config.vocab_size,
        target_hidden_size=target.config.hidden_size,
        # SGLang/SpecForge convention: id i = the output of target layer i = HF hidden_states index i + 1.
        eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]},
    )


def eagle_config(target: PreTrainedModel) -> LlamaConfig:
    """EAGLE-1's config: the target's RoPE, no `fc` bias (the Llama-3 drafts')."""
    return one_layer_config(
        target, "LlamaForCausalLMEagle", rope_parameters=dict(target.config.rope_parameters), bias=False
    )


def new_head(kind: str, target: PreTrainedModel) -> DraftHead:
    """A fresh draft head of `kind` ("eagle3" | "eagle" | "mtp") for `target`."""
    if kind == "eagle3":
        return Eagle3Head(target, eagle3_config(target))
    if kind == "eagle":
        return EagleHead(target, eagle_config(target))
    if kind == "mtp":
        return MTPHead(target)
    raise ValueError(f"unknown draft {kind!r}; expected one of {sorted(DRAFT_TARGETS)}")


def save_head(kind: str, head: DraftHead, target: PreTrainedModel, target_dir: Path, dtype: torch.dtype) -> Path:
    """Write the head in its published layout; returns the directory a loader reads it from.

    eagle3, eagle: a draft directory `<target_dir>-<kind>` beside the target. mtp: `model.layers.{L}.*`
    added to the target's own `model.safetensors`, with `num_nextn_predict_layers: 1`.
    """
    if isinstance(head, SiblingHead):
        out_dir = target_dir.parent / f"{target_dir.name}-{kind}"
        out_dir.mkdir(parents=True, exist_ok=True)
        config = head.config.to_dict()
        config["dtype"] = str(dtype).removeprefix("torch.")
        tensors = head.state(target)
    else:
        out_dir = target_dir
        tensors = load_file(target_dir / "model.safetensors") | head.state(target)
        config = json.loads((target_dir / "config.json").read_text())
        config["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(
        {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()},
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    return out_dir


DRAFT_TARGETS = {"eagle3": "demo-llama", "eagle": "demo-llama", "mtp": "demo-deepseek"}  # kind -> the target it serves
DISTILL_MAX_TOKENS = 160  # longest target completion generated for draft training
DISTILL_EPOCHS = 2  # passes over the generated chats (half the chats, half the generation time)


def self_distilled_rows(
    target_dir: Path, tokenizer: PreTrainedTokenizerBase, num_chats: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of corpus prompts with the target's OWN greedy completion as the assistant turn.

    EAGLE's data regeneration: the draft learns to predict what the target says (which is what it
    is verified against), not what the corpus says. Generated with tandem's plain engine.
    """
    from tandem.decoding.params import SamplingParams
    from tandem.llm import LLM

    llm = LLM(str(target_dir), None, max_num_seqs=16)
    prompts = [llm.chat_prompt(example.messages, example.tools) for example in generate_examples(num_chats, seed)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=DISTILL_MAX_TOKENS))
    return [
        (prompt + out.token_ids, [IGNORE_INDEX] * len(prompt) + out.token_ids) for prompt, out in zip(prompts, outputs)
    ]


def train_draft(kind: str, tokenizer: PreTrainedTokenizerBase, assets: Path, settings: TrainSettings) -> dict[str, Any]:
    """Train the `kind` draft of its demo target in `assets`, save it (`save_head`) and record how.

    Returns the record written beside it (`tandem_demo.json` of the EAGLE-3 / EAGLE directory;
    `tandem_mtp.json` in the DeepSeek target's directory).
    """
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    target_dir = assets / DRAFT_TARGETS[kind]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    head = new_head(kind, target)
    num_chats = settings.steps * settings.batch_size // DISTILL_EPOCHS
    rows = self_distilled_rows(target_dir, tokenizer, num_chats, settings.seed)
    batches = batch_rows(
        itertools.chain.from_iterable(itertools.repeat(rows, DISTILL_EPOCHS)),
        tokenizer.pad_token_id,
        settings.batch_size,
        settings.seed,
    )
    agreement_log: list[list[float]] = []

    def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        loss, agreement = ttt_loss(model, target, batch)
        agreement_log.append(agreement)
        return loss

    losses = train_model(head, batches, settings, desc=f"train {kind} draft of {target_dir.name}", loss_fn=loss_fn)
    dtype = getattr(torch, json.loads((target_dir / "config.json").read_text())["dtype"])  # the target's file dtype
    out_dir = save_head(kind, head, target, target_dir, dtype)
    tail = agreement_log[-summary_window(len(losses)) :]
    record = {
        "draft": kind,
        "target": target_dir.name,
        "training": asdict(settings),
        "data": {
            "self_distilled_chats": num_chats,
            "epochs": DISTILL_EPOCHS,
            "max_tokens": DISTILL_MAX_TOKENS,
            "generated_tokens": sum(len(labels) - labels.count(IGNORE_INDEX) for _, labels in rows),
        },
        "depths": DEPTHS,
        "depth_decay": DEPTH_DECAY,
        "num_parameters": sum(p.numel() for p in head.parameters() if p.requires_grad),
        **loss_summary(losses),
        "train_top1_agreement_by_depth": [round(sum(a[d] for a in tail) / len(tail), 4) for d in range(DEPTHS)],
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    record_file = out_dir / (SETTINGS_FILE if isinstance(head, SiblingHead) else f"tandem_{kind}.json")
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return record
