"""The optimizer loop, and `tandem train-draft`: an EAGLE-3 / EAGLE draft for any Llama-family target.

:class:`Trainer` is AdamW with warmup + cosine decay and a progress bar; its state (model,
optimizer, scheduler, step, losses) round-trips through :meth:`Trainer.state_dict`, so a run
resumes where it stopped. The demo trainer (:mod:`tandem.demo.train`) runs its targets and
drafts through it too.

:func:`train_draft`, in order: self-distilled data (the target answers the training prompts,
:func:`tandem.training.data.self_distill`), the draft vocabulary (EAGLE-3: the most frequent
tokens of those answers), TTT (:mod:`tandem.training.ttt`) with the target's forward run by
tandem's own provider (frozen, no grad), the published checkpoint, then the held-out accepted
length of the trained draft through :class:`tandem.LLM` (:func:`accepted_length`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from tqdm import tqdm
from transformers import AutoConfig, get_cosine_schedule_with_warmup

from tandem.models.llama3 import Llama3
from tandem.training.checkpoint import load_state, save_draft, save_state, set_rng_state
from tandem.training.data import IGNORE_INDEX, Chat, Epochs, Row, self_distill
from tandem.training.heads import Eagle3Head, EagleHead, SiblingHead, eagle3_config, eagle_config
from tandem.training.ttt import DEPTH_DECAY, provider_pass, scored_pairs, ttt_log_probs, ttt_loss
from tandem.training.vocab import DraftVocab, frequent_tokens

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, list[float]]]  # -> (loss, per-depth agreement)
DATA_FILE = "train_data.pt"  # the self-distilled rows and draft vocabulary, reused by --resume
RECORD_FILE = "tandem_train.json"  # how the draft was trained (the summary, saved beside it)


class OptimizerSettings(Protocol):
    """What a :class:`Trainer` reads of a run's settings (the demo's and the draft trainer's have them)."""

    steps: int
    lr: float
    warmup_steps: int
    weight_decay: float


class Trainer:
    """AdamW (betas 0.9, 0.95) with linear warmup and cosine decay over ``steps``, gradient norm clipped
    at 1, on the parameters of ``model`` that require grad."""

    def __init__(self, model: nn.Module, settings: OptimizerSettings):
        self.model, self.steps = model, settings.steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.95)
        )
        self.schedule = get_cosine_schedule_with_warmup(self.optimizer, settings.warmup_steps, settings.steps)
        self.step = 0
        self.resumed_from: int | None = None  # the step a resumed run started at
        self.losses: list[float] = []
        self.agreement: list[list[float]] = []  # per step, per depth (empty lists for a plain LM loss)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "step": self.step,
            "losses": self.losses,
            "agreement": self.agreement,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.step, self.losses, self.agreement = state["step"], state["losses"], state["agreement"]

    def run(
        self,
        batch_at: Callable[[int], dict[str, Tensor]],
        loss_fn: LossFn,
        desc: str,
        *,
        until: int | None = None,
        on_save: Callable[[], None] | None = None,
        save_every: int = 0,
    ) -> None:
        """Train from :attr:`step` up to ``until`` (default: all ``steps``) on ``batch_at(step)``; calls
        ``on_save`` every ``save_every`` steps (0: never). The bar shows the mean loss and per-depth
        agreement of the last 20 steps."""
        self.model.train()
        end = self.steps if until is None else min(until, self.steps)
        progress = tqdm(
            range(self.step, end), desc=desc, unit="step", dynamic_ncols=True, initial=self.step, total=self.steps
        )
        for _ in progress:
            loss, agreement = loss_fn(self.model, batch_at(self.step))
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"{desc}: loss became {loss.item()} at step {self.step}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.losses.append(loss.item())
            self.agreement.append(agreement)
            postfix = {"loss": f"{_mean(self.losses[-20:]):.3f}"}
            if agreement:
                postfix["agree"] = "/".join(f"{a:.2f}" for a in mean_agreement(self.agreement[-20:]))
            progress.set_postfix(postfix)
            if on_save is not None and save_every and self.step % save_every == 0:
                on_save()
        self.model.eval()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary_window(num_steps: int) -> int:
    """How many first/last steps the start/end figures of a training record average over."""
    return max(1, min(20, num_steps // 5))


def loss_summary(losses: list[float]) -> dict[str, float]:
    """`loss_start` / `loss_end` of a training record: the mean loss of the first / last steps."""
    window = summary_window(len(losses))
    return {"loss_start": round(sum(losses[:window]) / window, 4), "loss_end": round(sum(losses[-window:]) / window, 4)}


def mean_agreement(per_step: list[list[float]]) -> list[float]:
    """The per-depth mean of steps' agreement lists."""
    return [round(_mean([a[d] for a in per_step]), 4) for d in range(len(per_step[0]))]


@dataclass
class DraftSettings:
    """Everything that decides a trained draft (saved in its record)."""

    kind: str = "eagle3"  # "eagle3" | "eagle"
    steps: int = 1000
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0  # head init, held-out split, data order, sampling
    ttt_depth: int = 4  # chained depths trained
    draft_vocab_size: int | None = None  # EAGLE-3 only; None: the target's whole vocabulary
    max_new_tokens: int = 160  # longest self-distilled answer
    temperature: float = 0.0  # of the self-distilled answers (0: greedy)
    heldout: int = 16  # prompts held out for the accepted-length evaluation
    num_speculative_tokens: int = 4  # k of the evaluation
    save_every: int = 100  # steps between trainer-state checkpoints


def new_head(settings: DraftSettings, target_dir: Path, target: Llama3, vocab: DraftVocab | None) -> SiblingHead:
    """A fresh head of ``settings.kind`` for the loaded ``target`` (an EAGLE-3 one warm-started from its
    final norm and head), shaped by the target's Hugging Face config."""
    config = AutoConfig.from_pretrained(target_dir)
    if settings.kind == "eagle":
        return EagleHead(eagle_config(config))
    if settings.kind != "eagle3":
        raise ValueError(f"unknown draft kind {settings.kind!r}; expected 'eagle3' or 'eagle'")
    head = target.lm_head_proj.weight if target.lm_head_proj is not None else target.model.embed_tokens.weight
    size = target.vocab_size if vocab is None else vocab.size
    return Eagle3Head(eagle3_config(config, target.aux_layer_ids, size), target.model.norm.weight, head, vocab)


def distilled_data(
    target_dir: Path, chats: list[Chat], settings: DraftSettings, device: str, out_dir: Path, resume: bool
) -> dict[str, Any]:
    """``{"rows", "vocab_ids", "vocab_size", "generation_s"}``: the self-distilled training rows and the
    draft vocabulary's target ids (None: the full vocabulary), read back from ``out_dir`` on resume, else
    generated and saved there."""
    file = out_dir / DATA_FILE
    if resume and file.is_file():
        return torch.load(file, weights_only=True)
    from tandem.llm import LLM

    started = time.perf_counter()
    llm = LLM(str(target_dir), None, device=device, max_num_seqs=32)
    rows = self_distill(llm, chats, settings.max_new_tokens, settings.temperature, settings.seed)
    vocab_size = llm.target.vocab_size
    del llm
    vocab_ids = None
    if settings.kind == "eagle3" and settings.draft_vocab_size not in (None, vocab_size):
        answers = (t for _, labels in rows for t in labels if t != IGNORE_INDEX)
        vocab_ids = frequent_tokens(answers, vocab_size, settings.draft_vocab_size).token_ids
    data = {
        "rows": rows,
        "vocab_ids": vocab_ids,
        "vocab_size": vocab_size,
        "generation_s": round(time.perf_counter() - started, 1),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(data, file)
    return data


def fit(
    target_dir: Path,
    out_dir: Path,
    rows: list[Row],
    vocab: DraftVocab | None,
    settings: DraftSettings,
    device: str,
    pause_at: int | None,
    state: dict[str, Any] | None,
) -> tuple[SiblingHead, Trainer]:
    """TTT of a fresh head (or one resumed from the trainer ``state``) on ``rows`` against the target,
    run by tandem's provider (frozen); saves the trainer state every ``settings.save_every`` steps and at
    the end. The target is freed on return."""
    from tandem.models.loading import load_target, read_config

    target = load_target(target_dir, dtype=torch.float32 if device == "cpu" else None, device=device)
    head = new_head(settings, target_dir, target, vocab).to(device)
    trainer = Trainer(head, settings)
    if state is not None:
        trainer.load_state_dict(state)
        trainer.resumed_from = trainer.step
        set_rng_state(state["rng"])
    pad_id = read_config(target_dir).get("pad_token_id") or 0  # pads are never scored nor seen by real tokens
    epochs = Epochs(rows, pad_id, settings.batch_size, settings.seed)

    def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, list[float]]:
        where = scored_pairs(batch["labels"])
        out = provider_pass(target, model.hidden_kind, batch["input_ids"], batch["attention_mask"], where)
        where = where.to(device)
        draft = ttt_log_probs(model, target, out.embeds, out.features, settings.ttt_depth, where)
        return ttt_loss(draft, out.teacher, where.nonzero()[:, 1], vocab, DEPTH_DECAY)

    def save() -> None:
        save_state(trainer.state_dict(), out_dir)

    desc = f"train {settings.kind} draft of {target_dir.name}"
    trainer.run(epochs.at, loss_fn, desc, until=pause_at, on_save=save, save_every=settings.save_every)
    save()
    return head, trainer


def train_draft(
    target_dir: Path,
    out_dir: Path,
    train_chats: list[Chat],
    heldout_chats: list[Chat],
    settings: DraftSettings,
    *,
    device: str = "cpu",
    resume: bool = False,
    pause_at: int | None = None,
    baseline_draft: Path | None = None,
) -> dict[str, Any]:
    """Train a ``settings.kind`` draft of the target in ``target_dir`` and write it to ``out_dir``.

    resume: continue from ``out_dir``'s trainer state (same data, same batch order). pause_at: stop
    after that step with the state saved (the schedule still spans ``settings.steps``); no draft
    is written then. Returns the record (saved as ``tandem_train.json``): data, losses, agreement per
    depth, the held-out accepted length of the draft (and of ``baseline_draft``, same prompts), times.
    """
    from tandem.models.loading import read_config, resolve_dtype

    model_type = read_config(target_dir).get("model_type")
    if model_type != "llama":  # checked before generating anything
        raise ValueError(f"{target_dir}: train-draft trains drafts of Llama-family targets, not {model_type!r}")
    started = time.perf_counter()
    state = load_state(out_dir) if resume else None  # before generating: a missing state fails at once
    torch.manual_seed(settings.seed)
    data = distilled_data(target_dir, train_chats, settings, device, out_dir, resume)
    vocab = None if data["vocab_ids"] is None else DraftVocab(data["vocab_ids"].to(device), data["vocab_size"])
    train_started = time.perf_counter()
    head, trainer = fit(target_dir, out_dir, data["rows"], vocab, settings, device, pause_at, state)
    train_s = time.perf_counter() - train_started
    record: dict[str, Any] = {"step": trainer.step, "steps": settings.steps, "resumed_from": trainer.resumed_from}
    if trainer.step < settings.steps:
        return record | {"paused": True}
    save_draft(head, out_dir, resolve_dtype(None, read_config(target_dir)))  # the target checkpoint's dtype
    record |= {
        "draft": settings.kind,
        "target": str(target_dir),
        "settings": dataclasses.asdict(settings),
        "data": {
            "train_prompts": len(train_chats),
            "generated_tokens": sum(len(labels) - labels.count(IGNORE_INDEX) for _, labels in data["rows"]),
            "draft_vocab_size": data["vocab_size"] if vocab is None else vocab.size,
            "generation_s": data["generation_s"],
        },
        "num_parameters": sum(p.numel() for p in head.parameters()),
        **loss_summary(trainer.losses),
        "train_agreement_by_depth": mean_agreement(trainer.agreement[-summary_window(len(trainer.losses)) :]),
        "train_s": round(train_s, 3),
    }
    if heldout_chats:
        evaluate = dict(
            chats=heldout_chats,
            max_new_tokens=settings.max_new_tokens,
            k=settings.num_speculative_tokens,
            device=device,
        )
        record["heldout"] = {
            "prompts": len(heldout_chats),
            "accepted_length": accepted_length(target_dir, out_dir, **evaluate),
        }
        if baseline_draft is not None:
            record["heldout"]["baseline"] = {
                "draft": str(baseline_draft),
                "accepted_length": accepted_length(target_dir, baseline_draft, **evaluate),
            }
    record["wall_time_s"] = round(time.perf_counter() - started, 3)
    (out_dir / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def accepted_length(
    target_dir: Path, draft: Path | str | None, chats: list[Chat], max_new_tokens: int, k: int, device: str = "cpu"
) -> float:
    """Mean tokens per verify step (accepted drafts + 1) of ``draft`` over greedy answers to ``chats``,
    through :class:`tandem.LLM` at a fixed k (adaptive speculation off: it may verify fewer)."""
    from tandem.decoding.params import SamplingParams
    from tandem.llm import LLM

    llm = LLM(
        str(target_dir), None if draft is None else str(draft), num_speculative_tokens=k, device=device, max_num_seqs=16
    )
    llm.engine.config.adaptive = False
    prompts = [llm.chat_prompt(chat.messages, chat.tools) for chat in chats]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_new_tokens))
    steps = sum(o.stats.steps for o in outputs)
    return round((sum(o.stats.accepted for o in outputs) + steps) / steps, 4)
