"""`tandem bench` cut down to one model, one draft, one k, one batch, one round and a few tokens."""

from __future__ import annotations

import json

import pytest

from tandem.kernels import cpu_linear
from tests.cli.conftest import last_json_line

MODEL, DRAFT, K, BATCH, PROMPTS, MAX_TOKENS = "demo-llama", "eagle3", 2, 2, 2, 4


def test_bench_smallest_run_reports_runs_and_ratios(tandem):
    argv = ["--models", MODEL, "--drafts", DRAFT, "--k", K, "--batch", BATCH, "--prompts", PROMPTS]
    # one thread: on a loaded 2-core machine two contend and the run takes several times as long
    argv += ["--max-tokens", MAX_TOKENS, "--repeats", 1, "--device", "cpu", "--threads", 1, "--graph-mode", "eager"]
    out, err = tandem("bench", *argv, "--progress", "on")
    report = last_json_line(out)
    assert report["benchmark"] == "tandem bench" and report["device"] == "cpu" and report["threads"] == 1
    assert report["graph_modes"] == ["eager"]
    assert report["cpu_kernels"]["linear"] == cpu_linear.ISA  # the figures' C kernels (this process imports as it)
    assert (report["max_tokens"], report["prompts"], report["repeats"]) == (MAX_TOKENS, PROMPTS, 1)
    assert list(report["models"]) == [MODEL]
    result = report["models"][MODEL]

    runs = result["runs"]
    # plain: schema off/on; the draft at k: relaxed off/on x schema off/on
    cases = {(r["draft"], r["k"], r["relaxed"], r["schema"], r["batch"], r["graph_mode"]) for r in runs}
    expected = {("none", 0, False, s, BATCH, "eager") for s in (False, True)}
    expected |= {(DRAFT, K, relaxed, s, BATCH, "eager") for relaxed in (False, True) for s in (False, True)}
    assert len(runs) == len(cases) and cases == expected
    for run in runs:
        assert 0 < run["generated"] <= PROMPTS * MAX_TOKENS
        assert run["tokens_per_s"] > 0 and run["decode_tokens_per_s"] > 0
        assert 0 < run["first_token_seconds"] <= run["seconds"]
        assert 1 <= run["mean_accepted_length"] <= (K + 1 if run["draft"] != "none" else 1)
        if not run["relaxed"]:
            assert run["exact"] is True, run  # greedy speculation reproduces the plain tokens
            assert "token_match" not in run
        else:  # relaxed acceptance may change tokens: not checked for exactness, measured instead
            assert run["exact"] is None and 0 <= run["token_match"] <= 1, run
        if run["schema"]:
            assert 0 <= run["schema_valid"] <= 1, run
        else:
            assert "schema_valid" not in run
    assert [peer["mode"] for peer in result["transformers"]] == ["plain", "prompt_lookup"]
    assert all(peer["generated"] > 0 and peer["tokens_per_s"] > 0 for peer in result["transformers"])

    names = {"tandem_plain_vs_transformers_plain"}
    names |= {f"{DRAFT}_k{K}_batch{BATCH}_{ratio}" for ratio in ("vs_plain", "decode_vs_plain")}
    names |= {f"{DRAFT}_k{K}_batch{BATCH}_schema_vs_{other}" for other in ("unconstrained", "plain")}
    assert set(result["ratios"]) == set(result["ratio_range"]) == names
    for name, ratio in result["ratios"].items():
        low, high = result["ratio_range"][name]
        assert 0 < low <= ratio <= high and low == high, name  # one round: the range is that round's ratio

    assert "compiled_vs_eager" not in result and result["graph_runners"] == []  # eager only: nothing compiled

    # without --json each run and each transformers mode also gets a line, before the JSON
    lines = out.strip().splitlines()[:-1]
    assert len(lines) == len(runs) + len(result["transformers"]) and all(MODEL in line for line in lines)
    # the progress bar, asked for, went to stderr: the model, the case, the round and the time left
    assert f"{MODEL} {DRAFT} k={K} relaxed schema batch={BATCH} eager round 1/1" in err, err[-2000:]
    assert f"{MODEL} transformers prompt_lookup round 1/1" in err and "100%" in err


def test_bench_json_prints_one_line_and_no_bar_off_a_terminal(tandem):
    argv = ["--models", MODEL, "--drafts", "ngram", "--k", 1, "--batch", 1, "--prompts", 1, "--max-tokens", 2]
    out, err = tandem("bench", *argv, "--repeats", 1, "--device", "cpu", "--threads", 1, "--json")
    (line,) = out.splitlines()  # stdout: the JSON line alone
    result = json.loads(line)["models"][MODEL]
    assert {(r["draft"], r["graph_mode"]) for r in result["runs"]} == {("none", "auto"), ("ngram", "auto")}
    assert "ngram_k1_batch1_vs_plain" in result["ratios"]
    assert "round" not in err  # stderr is not a terminal (captured): --progress auto shows no bar


def test_compiled_vs_eager_ratios_pair_each_greedy_case_round_by_round():
    from tandem.cli.bench import _compiled_vs_eager

    def rounds_of(*seconds):
        return [{"generated": 100, "seconds": s} for s in seconds]

    rounds = {
        ("eagle3", 4, False, False, 1, "compiled"): rounds_of(1.0, 2.0, 1.0),
        ("eagle3", 4, False, False, 1, "eager"): rounds_of(2.0, 2.0, 4.0),
        ("eagle3", 4, False, True, 1, "compiled"): rounds_of(1.0),
        ("eagle3", 4, False, True, 1, "eager"): rounds_of(3.0),
        ("eagle3", 4, True, False, 1, "compiled"): rounds_of(1.0),  # relaxed: not a ratio
        ("eagle3", 4, True, False, 1, "eager"): rounds_of(1.0),
        ("none", 0, False, False, 8, "compiled"): rounds_of(1.0),  # no eager run to pair with
        ("transformers", "plain"): rounds_of(1.0),
    }
    ratios, ranges = _compiled_vs_eager(rounds)
    assert ratios == {"eagle3_k4_batch1": 2.0, "eagle3_k4_batch1_schema": 3.0}  # per round: 2, 1, 4
    assert ranges == {"eagle3_k4_batch1": [1.0, 4.0], "eagle3_k4_batch1_schema": [3.0, 3.0]}


def test_graph_runners_report_what_the_engine_exposes():
    from types import SimpleNamespace

    from tandem.cli.bench import _graph_runners

    runner = SimpleNamespace(compile_s=12.50004, fallbacks=3)
    engines = {
        ("eagle3", 4, False, "auto"): SimpleNamespace(engine=SimpleNamespace(runner=runner, graph_mode="compiled")),
        ("eagle3", 4, False, "eager"): SimpleNamespace(engine=SimpleNamespace(runner=None, graph_mode="eager")),
        ("none", 0, False, "auto"): SimpleNamespace(engine=SimpleNamespace()),  # an engine without graph mode
    }
    expected = {"draft": "eagle3", "k": 4, "relaxed": False, "graph_mode": "auto", "resolved": "compiled"}
    assert _graph_runners(engines) == [{**expected, "compile_s": 12.5, "fallbacks": 3}]


def test_token_match_counts_aligned_equal_tokens_and_unmatched_tails():
    from tandem.cli.bench import _token_match

    plain = [[1, 2, 3, 4], [5, 6]]
    assert _token_match([plain, plain], plain) == 1.0
    # prompt 0: 3 of 4 equal; prompt 1: 2 equal and one extra token -> 5 of 7
    assert _token_match([[[1, 2, 9, 4], [5, 6, 7]]], plain) == 5 / 7
    assert _token_match([[[], []]], [[], []]) == 1.0


def test_schema_answers_are_validated():
    from tandem.cli.bench import _valid, _validators

    (validator,) = _validators([{"type": "object", "required": ["a"]}])
    assert _valid(validator, '{"a": 1}') and not _valid(validator, '{"b": 1}') and not _valid(validator, '{"a": ')
    assert _validators([None]) == [None]


def test_draft_choices_cover_every_available_kind():
    from tandem.cli.bench import DRAFT_KINDS
    from tandem.llm import available_drafts, resolve_model

    for model in ("demo-llama", "demo-deepseek"):
        assert set(available_drafts(resolve_model(model))) <= set(DRAFT_KINDS)
    assert {"ngram", "suffix"} <= set(DRAFT_KINDS)


@pytest.mark.parametrize("option", ["--batch", "--k", "--repeats", "--prompts", "--max-tokens", "--threads"])
def test_a_count_below_one_is_refused_naming_the_option(option, capsys):
    """Each would have ended in a traceback (or, for --k, transformers' message about its n-gram size)."""
    from tandem import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", option, "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {option}: 0 is not a positive integer" in err
