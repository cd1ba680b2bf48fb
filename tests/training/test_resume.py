"""A paused run resumed with `--resume` ends with the same weights, optimizer state and losses as an
uninterrupted run of the same total steps: the trainer state holds the head, the optimizer, the
schedule, the step and the RNG states, and the batch of a step is a function of the step (`Epochs`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tandem.assets import DEMO_DEEPSEEK_DIR
from tandem.training.checkpoint import STATE_FILE
from tandem.training.data import DEFAULT_PROMPTS, Epochs, pad_batch, read_prompts
from tandem.training.trainer import DraftSettings, train_draft

SETTINGS = DraftSettings(steps=6, batch_size=4, warmup_steps=2, draft_vocab_size=256, max_new_tokens=24, save_every=0)


@pytest.fixture(scope="module")
def chats():
    return read_prompts(DEFAULT_PROMPTS)[:16]


def test_a_paused_and_resumed_run_equals_an_uninterrupted_one(tiny_target, chats, tmp_path):
    whole = train_draft(tiny_target, tmp_path / "whole", chats, [], SETTINGS)
    paused = train_draft(tiny_target, tmp_path / "split", chats, [], SETTINGS, pause_at=3)
    assert paused == {"step": 3, "steps": 6, "resumed_from": None, "paused": True}
    assert not (tmp_path / "split" / "model.safetensors").exists()  # no draft until the schedule ends
    resumed = train_draft(tiny_target, tmp_path / "split", chats, [], SETTINGS, resume=True)
    assert resumed["resumed_from"] == 3 and resumed["step"] == 6
    assert resumed["loss_end"] == whole["loss_end"] and resumed["loss_start"] == whole["loss_start"]
    states = [torch.load(tmp_path / run / STATE_FILE, weights_only=True) for run in ("whole", "split")]
    assert states[0]["losses"] == states[1]["losses"] and len(states[1]["losses"]) == 6
    for name, tensor in states[0]["model"].items():
        assert torch.equal(tensor, states[1]["model"][name]), name
    for key, value in states[0]["optimizer"]["state"][0].items():
        assert torch.equal(value, states[1]["optimizer"]["state"][0][key]), key
    drafts = [load_file(tmp_path / run / "model.safetensors") for run in ("whole", "split")]
    assert drafts[0].keys() == drafts[1].keys() and all(torch.equal(drafts[0][k], drafts[1][k]) for k in drafts[0])


def test_resume_without_a_trainer_state_says_so(tiny_target, chats, tmp_path):
    with pytest.raises(FileNotFoundError, match=STATE_FILE):
        train_draft(tiny_target, tmp_path, chats[:4], [], SETTINGS, resume=True)


def test_a_target_outside_the_llama_family_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="Llama-family targets, not 'deepseek_v3'"):
        train_draft(DEMO_DEEPSEEK_DIR, tmp_path, [], [], SETTINGS)
    assert not any(tmp_path.iterdir())


def test_epochs_give_each_step_the_same_batch_whatever_came_before():
    rows = [([1] * n, [-100] + [2] * (n - 1)) for n in range(3, 23)]
    fresh, walked = Epochs(rows, 0, 4, seed=1), Epochs(rows, 0, 4, seed=1)
    sequence = [walked.at(step) for step in range(12)]  # three passes of 5 batches
    for step in (11, 0, 7, 5):
        assert all(torch.equal(fresh.at(step)[k], sequence[step][k]) for k in sequence[step])
    first, second = sequence[:5], sequence[5:10]  # each pass holds every row once, in another order
    assert sorted(n for b in first for n in b["attention_mask"].sum(1).tolist()) == sorted(len(ids) for ids, _ in rows)
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, second))
    assert pad_batch(rows[:2], 0)["attention_mask"].sum().item() == 3 + 4
