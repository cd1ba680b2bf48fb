"""`tandem train-demo`: the tokenizer stage, then a target stage that reuses it.

tests/demo/test_train.py and tests/demo/test_drafts.py check the directories a target and a draft
stage write; this checks the stages' command-line contract: `--only tokenizer` writes the tokenizer
alone, a later target stage reads it instead of training another, and says what it trained.
"""

from __future__ import annotations

import json
import re

from tandem.demo.train import SETTINGS_FILE


def test_tokenizer_stage_then_a_target_stage_reusing_it(tandem, tmp_path):
    common = ["--out", tmp_path, "--size", "tiny", "--steps", "2", "--batch-size", "2", "--eval-examples", "2"]
    common += ["--threads", "1"]  # two threads contend on a loaded 2-core machine
    out, _ = tandem("train-demo", *common, "--only", "tokenizer")
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]  # that stage alone
    tokenizer_dir = tmp_path / "tokenizer"
    assert (tokenizer_dir / "tokenizer.json").is_file()
    assert json.loads((tokenizer_dir / SETTINGS_FILE).read_text())["corpus"] == {"seed": 0, "split": "train"}
    written = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tokenizer_dir.iterdir()}

    out, _ = tandem("train-demo", *common, "--only", "deepseek")
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tokenizer_dir.iterdir()} == written  # reused
    summary = re.fullmatch(
        r"demo-deepseek: loss ([\d.]+) -> ([\d.]+), held-out valid (\d+)/(\d+) \(exact (\d+)\), (\w+), [\d.]+ s",
        out.strip(),
    )
    assert summary, out
    record = json.loads((tmp_path / "demo-deepseek" / SETTINGS_FILE).read_text())
    assert (float(summary[1]), float(summary[2])) == (record["loss_start"], record["loss_end"])
    valid, total, exact = int(summary[3]), int(summary[4]), int(summary[5])
    assert total == 2 and exact <= valid <= total
    assert (tmp_path / "demo-deepseek" / "tokenizer.json").read_bytes() == written["tokenizer.json"][0]
