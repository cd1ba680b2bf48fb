"""`tandem train-draft`: prompts from a jsonl file in both forms, a paused run resumed from its step, a
JSON summary with the held-out accepted length, and a draft directory `LLM(target, draft=DIR)` reads."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main
from tandem.llm import LLM
from tandem.training.data import read_prompts


def run(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["train-draft", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_eagle_draft_paused_then_resumed_through_the_command(tiny_target, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Count to {n} in words."} for n in range(3, 9)]
    lines += [{"messages": [{"role": "user", "content": "Name a city."}]}, {"prompt": "Why is the sky blue?"}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "draft"
    common = ["--target", tiny_target, "--kind", "eagle", "--out", out, "--prompts", prompts, "--steps", 4]
    common += ["--batch-size", 2, "--max-new-tokens", 12, "--heldout", 2, "--warmup-steps", 1]
    paused = run(capsys, *common, "--pause-at", 2)
    assert paused == {"step": 2, "steps": 4, "resumed_from": None, "paused": True}
    record = run(capsys, *common, "--resume")
    assert record["resumed_from"] == 2 and record["step"] == 4 and record["draft"] == "eagle"
    assert record["data"]["train_prompts"] == 6 and record["data"]["generated_tokens"] > 0
    assert record["heldout"]["prompts"] == 2 and record["heldout"]["accepted_length"] >= 1.0
    assert record["train_s"] > 0 and record["wall_time_s"] >= record["train_s"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert LLM(str(tiny_target), str(out)).draft.hidden_kind == "last"


def test_prompt_files_name_the_line_they_cannot_read(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_prompts(bad)
