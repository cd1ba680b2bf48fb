"""Training the shipped demo drafts: EAGLE-3 and EAGLE-1 for demo-llama, the MTP layer of demo-deepseek.

All three are trained with training-time test (:mod:`tandem.training.ttt`: chained depths, the
distillation loss against the frozen target, per-depth agreement) on the target's own greedy
completions of corpus prompts (`self_distilled_rows`): the draft learns what the target says.
Here the frozen target is transformers' model of the demo target; `tandem train-draft`
(:mod:`tandem.training.trainer`) runs the same math against tandem's own provider for any
Llama-family target.

The EAGLE heads are :mod:`tandem.training.heads`' (transformers' layers, published key names); the
MTP head, DeepSeek-specific, lives here. What tandem ships is read by the same loaders as real
checkpoints (`tandem.models.drafts.eagle3`, `tandem.models.drafts.eagle`, and
`tandem.models.drafts.mtp` from `model.layers.{L}.*` of the target's own checkpoint, as in DeepSeek-V3).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, Cache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from tandem.demo.corpus import generate_examples
from tandem.demo.train import SETTINGS_FILE, TrainSettings
from tandem.models.base import default_aux_layer_ids
from tandem.training.checkpoint import save_draft
from tandem.training.data import IGNORE_INDEX, Chat, batch_rows, self_distill
from tandem.training.heads import Eagle3Head, EagleHead, SiblingHead, eagle3_config, eagle_config
from tandem.training.trainer import Trainer, loss_summary, mean_agreement, summary_window
from tandem.training.ttt import DEPTH_DECAY, DEPTHS, scored_pairs, ttt_log_probs, ttt_loss


class MTPHead(nn.Module):
    """DeepSeek-V3's MTP module in transformers' layers; saved as `model.layers.{L}.*` of the target."""

    hidden_kind = "last"

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

    def features(self, captured: Tensor) -> Tensor:
        """The last hidden state after the final norm ``[B, T, H]`` is the depth-0 hidden."""
        return captured

    def layer(self, embeds: Tensor, hidden: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: Cache) -> Tensor:
        """[B, N, H] embeddings and hidden inputs -> pre-norm outputs g [B, N, H] (embedding first)."""
        fused = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.block(fused, attention_mask=mask, position_embeddings=rope, cache=cache)

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
    head: DraftHead,
    target: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    depths: int = DEPTHS,
    where: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """The target's next-token logits and the draft's log-probs per depth (transformers' target), at every
    pair ``[B, P, V]`` or at the pairs ``where [B, P]`` selects ``[N, V]``.

    input_ids, attention_mask: [B, T] (right-padded); :func:`tandem.training.ttt.ttt_log_probs` chains the head.
    """
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        embeds = target.get_input_embeddings()(input_ids[:, 1:])  # [B, P, H]
        if head.hidden_kind == "aux":
            aux = default_aux_layer_ids(target.config.num_hidden_layers)
            captured = torch.cat([out.hidden_states[i] for i in aux], dim=-1)
        else:
            captured = out.hidden_states[-1]
    teacher = out.logits[:, 1:].float()
    draft = ttt_log_probs(head, target, embeds, captured[:, :-1], depths, where)
    return (teacher if where is None else teacher[where]), draft


def new_head(kind: str, target: PreTrainedModel) -> DraftHead:
    """A fresh draft head of `kind` ("eagle3" | "eagle" | "mtp") for `target` (full vocabulary)."""
    config = target.config
    if kind == "eagle3":
        aux = default_aux_layer_ids(config.num_hidden_layers)
        return Eagle3Head(
            eagle3_config(config, aux, config.vocab_size), target.model.norm.weight, target.lm_head.weight
        )
    if kind == "eagle":
        return EagleHead(eagle_config(config))
    if kind == "mtp":
        return MTPHead(target)
    raise ValueError(f"unknown draft {kind!r}; expected one of {sorted(DRAFT_TARGETS)}")


def save_head(kind: str, head: DraftHead, target: PreTrainedModel, target_dir: Path, dtype: torch.dtype) -> Path:
    """Write the head in its published layout; returns the directory a loader reads it from.

    eagle3, eagle: a draft directory `<target_dir>-<kind>` beside the target. mtp: `model.layers.{L}.*`
    added to the target's own `model.safetensors`, with `num_nextn_predict_layers: 1`.
    """
    if isinstance(head, SiblingHead):
        return save_draft(head, target_dir.parent / f"{target_dir.name}-{kind}", dtype)
    tensors = load_file(target_dir / "model.safetensors") | head.state(target)
    config = json.loads((target_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (target_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(
        {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()},
        target_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    return target_dir


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
    from tandem.llm import LLM

    llm = LLM(str(target_dir), None, max_num_seqs=16)
    chats = [Chat(example.messages, example.tools) for example in generate_examples(num_chats, seed)]
    return self_distill(llm, chats, DISTILL_MAX_TOKENS, temperature=0.0, seed=seed)


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
    trainer = Trainer(head, settings)

    def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, list[float]]:
        where = scored_pairs(batch["labels"])
        teacher, draft = ttt_forward(model, target, batch["input_ids"], batch["attention_mask"], where=where)
        return ttt_loss(draft, teacher, where.nonzero()[:, 1])

    trainer.run(lambda _: next(batches), loss_fn, desc=f"train {kind} draft of {target_dir.name}")
    losses = trainer.losses
    dtype = getattr(torch, json.loads((target_dir / "config.json").read_text())["dtype"])  # the target's file dtype
    out_dir = save_head(kind, head, target, target_dir, dtype)
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
        "train_top1_agreement_by_depth": mean_agreement(trainer.agreement[-summary_window(len(losses)) :]),
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    record_file = out_dir / (SETTINGS_FILE if isinstance(head, SiblingHead) else f"tandem_{kind}.json")
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return record
