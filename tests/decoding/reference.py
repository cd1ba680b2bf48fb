"""Straightforward per-row references for the acceptance rules, written from the spec
(docs/DESIGN.md, tandem/decoding/acceptance.py's docstring) with Python loops and float64."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import stats

# Every statistical test here rejects a correct implementation with probability ALPHA
# (for a random seed; with the suite's fixed seeds the outcome is repeatable). Bonferroni
# over the ~250 statistical checks the suite runs bounds the suite's false-alarm rate by 2.5%.
ALPHA = 1e-4
Z_CRIT = float(stats.norm.isf(ALPHA / 2))  # two-sided


def reference_probs(
    logits: torch.Tensor,
    allowed: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray | None:
    """Target distribution of one position, [V] float64; None at a dead end."""
    values = logits.double().numpy().copy()
    if allowed is not None:
        values[~allowed.numpy()] = -np.inf
    if np.all(values == -np.inf):
        return None
    if temperature == 0:
        probs = np.zeros_like(values)
        probs[int(np.argmax(values))] = 1.0
        return probs
    values = values / temperature
    if top_k > 0:
        kth = sorted(values, reverse=True)[min(top_k, len(values)) - 1]
        values[values < kth] = -np.inf
    if top_p < 1:
        probs = _softmax(values)
        order = sorted(range(len(values)), key=lambda i: (-probs[i], i))
        kept, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.add(i)
            mass += probs[i]
        values[[i for i in range(len(values)) if i not in kept]] = -np.inf
    if min_p > 0:
        probs = _softmax(values)
        values[probs < min_p * probs.max()] = -np.inf
    return _softmax(values)


def _softmax(values: np.ndarray) -> np.ndarray:
    exp = np.exp(values - values.max())
    return exp / exp.sum()


def reference_greedy(logits: torch.Tensor, drafts: torch.Tensor, allowed: torch.Tensor | None = None):
    """Greedy acceptance of one row: (num_accepted, tokens [k+1] with -1 padding, dead_end)."""
    k = drafts.shape[0]
    tokens = [-1] * (k + 1)
    for j in range(k + 1):
        probs = reference_probs(logits[j], None if allowed is None else allowed[j], temperature=0)
        if probs is None:
            return j, tokens, True
        best = int(np.argmax(probs))
        if j < k and int(drafts[j]) == best:
            tokens[j] = best
            continue
        tokens[j] = best
        return j, tokens, False
    raise AssertionError("unreachable")


def reference_relaxed_ok(logits: torch.Tensor, draft: int, allowed: torch.Tensor | None, top_k: int, delta: float):
    """The relaxed rule at one position (without the row's fallback rule)."""
    values = logits.double().numpy().copy()
    if allowed is not None:
        if not bool(allowed[draft]):
            return False
        values[~allowed.numpy()] = -np.inf
    if np.all(values == -np.inf):
        return False
    probs = _softmax(values)
    rank = sum(1 for i, p in enumerate(probs) if p > probs[draft] or (p == probs[draft] and i < draft))
    return rank < top_k and probs[draft] >= probs.max() - delta


def assert_distributed_as(samples: torch.Tensor, probs: np.ndarray, what: str) -> None:
    """Chi-square goodness of fit at level ALPHA, plus: no sample where probs is 0."""
    counts = np.bincount(samples.numpy(), minlength=len(probs)).astype(float)
    impossible = counts[probs == 0].sum()
    assert impossible == 0, f"{what}: {int(impossible)} samples of tokens with probability 0"
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected > 0) & (expected < 5)  # pool the small bins into one
    observed_bins = list(counts[big]) + ([counts[small].sum()] if small.any() else [])
    expected_bins = list(expected[big]) + ([expected[small].sum()] if small.any() else [])
    if len(observed_bins) < 2:
        return
    # Re-normalise against float64 rounding so scipy's sum check passes.
    expected_arr = np.array(expected_bins) * (sum(observed_bins) / sum(expected_bins))
    p_value = stats.chisquare(observed_bins, expected_arr).pvalue
    assert p_value > ALPHA, f"{what}: chi-square p = {p_value:.2e} over {int(counts.sum())} samples"


def assert_rate(successes: int, trials: int, expected: float, what: str) -> None:
    """Two-sided z-test of a binomial rate at level ALPHA."""
    if expected in (0.0, 1.0):
        assert successes == expected * trials, f"{what}: {successes}/{trials}, expected rate {expected}"
        return
    z = (successes - trials * expected) / math.sqrt(trials * expected * (1 - expected))
    assert abs(z) < Z_CRIT, (
        f"{what}: {successes}/{trials} = {successes / trials:.4f}, expected {expected:.4f} (z = {z:.1f})"
    )
