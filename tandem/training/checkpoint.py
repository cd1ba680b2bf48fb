"""What a draft training writes: the published draft layout, and the trainer's own state to resume from.

Published layout (what ``LLM(target, draft=DIR)``, SGLang, vLLM and SpecForge read): ``config.json``
(the head's Llama config; ``architectures`` names the draft kind) and ``model.safetensors`` (the
head's weights under the published keys, with ``d2t``/``t2d`` for a reduced EAGLE-3 vocabulary), in
the target's dtype. Trainer state (``trainer_state.pt``, beside them): the head, optimizer,
scheduler, step, RNG states and the losses so far; the data position is the step
(:class:`tandem.training.data.Epochs` is deterministic).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.training.heads import SiblingHead

STATE_FILE = "trainer_state.pt"


def save_draft(head: SiblingHead, out_dir: Path, dtype: torch.dtype) -> Path:
    """Write ``head`` in the published layout into ``out_dir`` (created); returns ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state().items()}
    save_file(
        {k: v if k in ("d2t", "t2d") else v.to(dtype) for k, v in tensors.items()},  # the maps keep their dtypes
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    return out_dir


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may draw from."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(state: dict[str, Any], out_dir: Path) -> None:
    """Write a trainer state atomically (a crash mid-write leaves the previous one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f"{STATE_FILE}.partial"
    torch.save(state | {"rng": rng_state()}, partial)
    partial.replace(out_dir / STATE_FILE)


def load_state(out_dir: Path) -> dict[str, Any]:
    """The trainer state in ``out_dir`` (its ``rng`` for :func:`set_rng_state`); FileNotFoundError when none."""
    file = out_dir / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"--resume: no {STATE_FILE} in {out_dir}")
    return torch.load(file, weights_only=True)
