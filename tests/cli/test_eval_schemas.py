"""`tandem eval-schemas` on a handful of MaskBench files and JSON-Schema-Test-Suite files."""

from __future__ import annotations

import shutil

from tandem.grammars.backends import BACKENDS
from tandem.grammars.support import HONOURED
from tests.cli.conftest import last_json_line


def test_eval_schemas_json_summary(tandem, maskbench):
    out, err = tandem("eval-schemas", maskbench, "--limit", "12", "--sample", "--json")
    summary = last_json_line(out)
    assert summary["files"] == 12 and summary["strict"] is True
    assert summary["tokenizer"].endswith("tokenizer")  # the shipped one, by default
    assert set(summary["backends"]) == {*BACKENDS, "auto"}
    for report in summary["backends"].values():
        assert report["schemas"] == 12
        assert report["compiled"] + report["refused"] + report["failed"] + report["timed_out"] == 12
        assert report["valid_accepted"] <= report["valid"] and report["invalid_wrongly_accepted"] <= report["invalid"]
        assert sum(report["chosen"].values()) == report["compiled"]
        splits = report["splits"].values()
        assert sum(split["compiled"] for split in splits) == report["compiled"]
        for split in splits:  # per split, the mask times of the instances walked, the compile times of the schemas
            assert (split["mask_us_per_token_p50"] is None) == (split["valid"] + split["invalid"] == 0)
            assert (split["compile_ms_p99"] is None) == (split["compiled"] == 0)
    auto = summary["backends"]["auto"]
    assert auto["compiled"] > 0 and auto["valid_accepted"] > 0
    assert set(auto["chosen"]) <= set(BACKENDS)
    assert auto["invalid_wrongly_accepted"] == 0, auto["wrongly_accepted_files"]
    assert len(err.strip().splitlines()) == len(summary["backends"])  # with --json the per-backend lines go to stderr


def test_eval_schemas_measure_keywords_lists_only_labels_the_table_honours(tandem, schema_suite, tmp_path):
    for name in ("maxLength", "enum", "minimum"):  # cheap to compile for every backend
        shutil.copy(schema_suite / f"{name}.json", tmp_path)
    out, _ = tandem("eval-schemas", tmp_path, "--measure-keywords")
    table = last_json_line(out)
    assert set(table) == set(BACKENDS)
    for backend, labels in table.items():
        assert labels == sorted(labels) and "enum" in labels, backend
        assert set(labels) <= HONOURED[backend], f"{backend}: {set(labels) - HONOURED[backend]} not in the table"
