"""`tandem eval-schemas` on a handful of MaskBench files."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main
from tests.grammars.conftest import MASKBENCH


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason=f"MaskBench not at {MASKBENCH}")
def test_eval_schemas_json_summary(hf_tokenizer, tmp_path, capsys):
    hf_tokenizer.save_pretrained(tmp_path / "tok")
    argv = ["eval-schemas", str(MASKBENCH), "--tokenizer", str(tmp_path / "tok"), "--limit", "12", "--sample", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["files"] == 12 and set(summary["backends"]) == {"xgrammar", "llguidance", "outlines", "auto"}
    for backend, report in summary["backends"].items():
        assert report["schemas"] == 12
        assert report["compiled"] + report["refused"] + report["failed"] + report["timed_out"] == 12
        assert report["valid_accepted"] <= report["valid"]
    auto = summary["backends"]["auto"]
    assert auto["compiled"] > 0 and auto["valid_accepted"] > 0
    assert auto["invalid_wrongly_accepted"] == 0, auto["wrongly_accepted_files"]
