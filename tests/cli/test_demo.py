"""`tandem demo`: the acceptance pipeline on a synthetic batch, against the exact acceptance rates."""

from __future__ import annotations

import pytest

from tests.cli.conftest import last_json_line

ROWS, K, VOCAB = 2048, 3, 256
KINDS = ("greedy", "stochastic", "stochastic+mask", "greedy+relaxed")
# A measured rate over ROWS independent rows has standard deviation at most sqrt(1/4 / ROWS) ~ 0.011;
# 0.05 is 4.5 of them (and the seed is fixed, so a pass repeats).
TOLERANCE = 0.05


def test_demo_json_matches_the_theory(tandem):
    out, _ = tandem("demo", "--rows", ROWS, "-k", K, "--vocab", VOCAB, "--json")
    report = last_json_line(out)
    assert (report["rows"], report["k"], report["vocab"]) == (ROWS, K, VOCAB)
    expected, expected_prefix = report["expected_stochastic_rate"], report["expected_stochastic_prefix_rate"]
    assert len(expected) == len(expected_prefix) == K and all(0 < rate <= 1 for rate in expected)
    for name in KINDS:
        kind = report[name]
        prefix = kind["prefix_accepted_rate"]
        assert 1 <= kind["mean_accepted_length"] <= K + 1, name  # accepted drafts + the target's own token
        assert len(prefix) == K and all(0 <= rate <= 1 for rate in prefix), name
        assert all(later <= earlier for earlier, later in zip(prefix, prefix[1:])), f"{name}: {prefix}"
        # every row emits its accepted drafts and one more token
        assert kind["mean_accepted_length"] == pytest.approx(1 + sum(prefix), abs=1e-3 * (K + 1)), name
    measured = report["stochastic"]["prefix_accepted_rate"]
    assert measured[0] == pytest.approx(expected[0], abs=TOLERANCE)
    assert measured == pytest.approx(expected_prefix, abs=TOLERANCE)
    # relaxed acceptance takes every draft greedy takes (the target's top token) and more
    greedy, relaxed = report["greedy"]["prefix_accepted_rate"], report["greedy+relaxed"]["prefix_accepted_rate"]
    assert all(r >= g for g, r in zip(greedy, relaxed)) and relaxed[-1] > greedy[-1]


def test_demo_text_output(tandem):
    out, _ = tandem("demo", "--rows", 64, "-k", K, "--vocab", 64)
    lines = out.strip().splitlines()
    assert lines[0].startswith("accept() on 64 rows x k=3, vocab 64")
    assert "sum_x min(p, q)" in lines[1] and "P(drafts 0..j all accepted)" in lines[2]
    assert [line.split()[0] for line in lines[3:]] == list(KINDS)
    assert all("mean accepted length" in line for line in lines[3:])
