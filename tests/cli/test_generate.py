"""`tandem generate` on the shipped demo models: text and JSON output, with and without a schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tandem.assets import DEFAULT_MODEL
from tandem.cli import main
from tandem.engine import EngineConfig
from tests.cli.conftest import last_json_line

MAX_TOKENS = 64  # room for the demo models' short reasoning and answer
LABEL_SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
    "required": ["label"],
    "additionalProperties": False,
}


def test_generate_prints_reasoning_then_answer_and_stats(tandem):
    out, err = tandem("generate", "--max-tokens", MAX_TOKENS)
    head, *_, tail = err.strip().splitlines()
    assert head == f"[{DEFAULT_MODEL} + mtp, k=4]"  # the default model speculates with its own MTP layer
    stats = re.fullmatch(r"\[(stop|length); (\d+) tokens in (\d+) steps, mean accepted length ([\d.]+)\]", tail)
    assert stats, tail
    reason, tokens, steps, accepted_length = stats[1], int(stats[2]), int(stats[3]), float(stats[4])
    assert 1 <= steps <= tokens <= MAX_TOKENS and 1 <= accepted_length <= 5
    reasoning = re.match(r"<think>(.*?)</think>\n", out, re.DOTALL)
    assert reasoning and reasoning[1].strip(), out
    answer = out[reasoning.end() :].strip()
    if reason == "stop":
        assert answer, out
        json.loads(answer)  # the demo models answer in JSON


def test_generate_json_with_a_schema_follows_it(tandem, tmp_path):
    schema = tmp_path / "label.json"
    schema.write_text(json.dumps(LABEL_SCHEMA))
    argv = ["generate", "I loved this kettle.", "--model", "demo-llama", "-k", "2", "--graph-mode", "eager"]
    out, _ = tandem(*argv, "--schema", schema, "--max-tokens", MAX_TOKENS, "--json")
    result = last_json_line(out)
    assert result["model"] == "demo-llama" and result["draft"] == "eagle3"  # its best shipped draft
    assert result["reasoning"]
    stats = result["stats"]
    widest = 2 + EngineConfig().max_forced_drafts  # k = 2 model drafts, and the grammar-forced ones beyond them
    assert 1 <= stats["steps"] and stats["accepted"] <= stats["drafted"] <= widest * stats["steps"]
    assert result["finish_reason"] in ("stop", "length")
    if result["finish_reason"] == "stop":
        jsonschema.validate(json.loads(result["text"]), LABEL_SCHEMA)


def test_generate_rejects_a_schema_file_that_is_not_json(tmp_path, capsys):
    schema = tmp_path / "broken.json"
    schema.write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--schema", str(schema)])
    assert exit_info.value.code == 2
    assert f"--schema {schema}: not JSON" in capsys.readouterr().err


def test_generate_takes_a_schema_inline_and_names_a_missing_file(tmp_path, capsys):
    from tandem.cli.generate import _read_schema

    assert _read_schema(f"  {json.dumps(LABEL_SCHEMA)}") == LABEL_SCHEMA
    long = {**LABEL_SCHEMA, "description": "x" * 400}  # longer than a file name may be
    assert _read_schema(json.dumps(long)) == long
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--schema", '{"type": "objec'])
    assert exit_info.value.code == 2 and "--schema inline: not JSON" in capsys.readouterr().err
    missing = tmp_path / "label.json"
    with pytest.raises(SystemExit):
        main(["generate", "--schema", str(missing)])
    assert f"--schema {missing}: No such file or directory (nor a schema inline" in capsys.readouterr().err


def test_generate_with_async_scheduling_prints_the_synchronous_answer(tandem):
    """A plain model decoding with async scheduling answers as it does synchronously, greedy."""
    argv = ["generate", "--model", "demo-llama", "--draft", "none", "--graph-mode", "eager", "--max-tokens", MAX_TOKENS]
    outputs = [tandem(*argv, *flag)[0] for flag in ([], ["--async-scheduling"])]
    assert outputs[0] == outputs[1] and outputs[0].strip()
