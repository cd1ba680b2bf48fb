"""Adaptive speculation: how many drafts each row verifies next step.

The rule. Each row b keeps an estimate ``a_b`` of the probability that a draft position is accepted
given that the ones before it were: a discounted count of accepted over tried positions with a prior
(``(S + w * a0) / (N + w)``, S and N decayed by ``decay`` each update; a position is tried when all
drafts before it were accepted; a0 is the same estimate over all rows, decayed by 0.99, so that a new
row starts from the draft's recent acceptance). A row verifying j drafts then commits, in expectation,

    E_b(j) = 1 + a + ... + a^j = (1 - a^(j+1)) / (1 - a)

tokens. All rows share the step, whose time is ``cost(T) + draft(J) + o`` for ``T = sum_b (j_b + 1)`` verified
tokens: ``cost`` is the measured time of a step from its start (scheduling, staging the verify's inputs) to its
commit over T tokens (`CostModel`, calibrated once at engine start from forwards plus acceptance, then the median
of the steps' own recent times at each T, fitted non-decreasing), ``o`` the rest of a step's period, from one
step's start to the next one's less what entered cost and draft (the draft's choice and walks, deferring, the
caller's handling of the step's output: the median of its recent values), and ``draft(J)`` the measured time of a
proposal of J chained
passes, ``J = max_b j_b``: the draft proposes only as far as the row that drafts most (a `CostModel` over
passes, from the proposals' own timings; while one length alone is timed, longer ones are read at its cost, so
the policy tries them: `AdaptivePolicy.draft_seconds`). When no row drafts (J = 0) the draft does not run: a
draft without state needs nothing, and one that reads the target's hidden states takes the step's tokens when a row next
drafts (`batching.defer_draft`; that proposal's first pass is wider, so its time enters no point of draft(J), nor
does a proposal's after a prefill, whose first pass takes the prompt);
over several ranks, where the ranks run such a draft, it runs its first pass anyway (J is at least 1 for it).
A proposal left on the device (`Request.drafts_on_device`) is timed as the host launches it: the device's part
lands in the next step's cost, whose commit waits for it, so a drafting step still pays for its proposal. A lookahead
proposal (`Engine._lookahead`, graph mode on CUDA) runs inside the verify's timing, so with lookaheads draft(J) is
never timed and stays 0: cost(T) of a drafting step holds it.
The policy picks the ``j_b`` in 0..k_max maximising

    sum_b E_b(j_b) / (cost(sum_b (j_b + 1)) + draft(max_b j_b) + o)

exactly: the marginal gain of a row's j-th draft is ``a_b^j``, decreasing in j, so for a cap J on every
row's drafts and a total of m drafts the best allocation is the m largest marginals with j <= J; the
policy scans J = 0 .. k_max and m = 0 .. B * J. m = 0 (every row 0: the plain step) is one of the
options, so by the model the choice is never slower than plain decoding. ``o`` is paid by every option alike, so
it weighs against a step that commits few tokens: where the device is fast and the host's work per step is a
large share of a step (a GPU in graph mode), it is what makes drafting pay. A row that has drafted nothing
for ``probe_every`` steps drafts one position anyway, so its estimate can recover when the text turns
predictable.

Sampled rows (temperature > 0) are pinned to k_max. The lossless rule keeps their distribution
whatever k is, but which tokens a seed draws depends on where the draws fall, hence on k; a choice
driven by timings and by the other rows would make a seeded row's tokens depend on the machine and the
batch, which tandem promises they do not (docs/DESIGN.md, "Acceptance rules"). Greedy rows' tokens do not
depend on k, so only they adapt.

Only host numbers enter (the acceptance counts the commit already read, and timings): choosing costs no
device read, only Python ints and floats, O(B * k_max log(B * k_max)).

Grammar-forced drafts. A position where a row's grammar allows one token is accepted with certainty once
reached. After the drafts chosen above, a row may verify the run of forced tokens that follows them:
every token of that run gains the probability of reaching it, the product of the factors of the drafts
before it (1 for a forced one, else ``a``), and costs one verified token; the run's outcome does not
enter the row's estimate (forced positions among the chosen drafts do: ``a`` predicts windows that hold
the same mix). `forced_extension` adds the runs, highest reach
first, while they raise the step's expected tokens per second; sampled rows take theirs always (their
drafts may not depend on timings, see above).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import operator
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW = 9  # a cost point is the median of its last this many timings: robust to stalls, follows the device's drift
STALE = 64  # a cost point untimed for this many of its model's timings leaves it


class CostModel:
    """Seconds of a step by its size (a verify's T tokens, a proposal's passes): a non-decreasing fit of the
    measured points, interpolated linearly between them; below the first point along the first segment (never
    under the cost in proportion to the size, which is the rule with one point), past the last with the steeper
    of the last segment's slope and the fit's mean slope (0 with no point yet).

    A point is the median of its last :data:`WINDOW` timings, so a stall (another process, a collection)
    moves it not at all, and the engine's own per-step work on this device is part of it. The fit is the weighted
    isotonic regression of the points (pool adjacent violators), each weighing as many timings as it has had: a
    longer step never costs less, since a noisy measurement that made a wider verify look cheaper would make
    drafts look free to verify, and a size timed once or twice cannot lift the well-timed sizes above it.

    The policy times only the sizes it chooses, so a point that reads too dear (timed in a slow moment, or before
    the device warmed) would keep it from choosing that size, and so from timing it again, for the rest of the run.
    A point untimed for :data:`STALE` of the model's timings therefore leaves it: the size is then read from its
    neighbours, and chosen and timed afresh where they make it pay. A size's first timing enters no point:
    the first step at a new shape is a warm-up (a graph built, buffers allocated), often many times a step's
    time; the sizes given at construction count as warmed."""

    def __init__(self, tokens: list[int], seconds: list[float]) -> None:
        """Points at the increasing sizes `tokens`, each one timing (`seconds`)."""
        self.tokens = list(tokens)
        self.seconds = list(seconds)  # each point's value: the median of its recent timings (the lower middle one)
        self._timings = [collections.deque([t], maxlen=WINDOW) for t in seconds]
        self._counts = [1] * len(self.tokens)  # timings each point has had: its weight in the fit
        self._timed = [0] * len(self.tokens)  # each point's last timing, on the `_clock`
        self._clock = 0  # timings observed
        self._warmed = set(self.tokens)  # sizes whose first timing came
        self._fit()

    def _fit(self) -> None:
        blocks: list[list[float]] = []  # [mean, weight, points] of pooled runs of points
        for seconds, weight in zip(self.seconds, self._counts):
            blocks.append([seconds, float(weight), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m1, w1, n1), (m2, w2, n2) = blocks.pop(-2), blocks.pop()
                blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
        self._fitted = [mean for mean, _, points in blocks for _ in range(points)]

    def __call__(self, num_tokens: int) -> float:
        ts, cs = self.tokens, self._fitted
        if not ts:
            return 0.0
        if len(ts) == 1:
            return cs[0] * num_tokens / ts[0]
        if num_tokens <= ts[0]:
            slope = (cs[1] - cs[0]) / (ts[1] - ts[0])
            return max(cs[0] - slope * (ts[0] - num_tokens), cs[0] * num_tokens / ts[0])
        if num_tokens > ts[-1]:
            slope = max((cs[-1] - cs[-2]) / (ts[-1] - ts[-2]), (cs[-1] - cs[0]) / (ts[-1] - ts[0]))
            return cs[-1] + slope * (num_tokens - ts[-1])
        i = bisect.bisect_left(ts, num_tokens)
        t0, t1, c0, c1 = ts[i - 1], ts[i], cs[i - 1], cs[i]
        return c0 + (c1 - c0) * (num_tokens - t0) / (t1 - t0)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step's measured time at size `num_tokens` (the class docstring says where it goes)."""
        self._clock += 1
        i = bisect.bisect_left(self.tokens, num_tokens)
        if i < len(self.tokens) and self.tokens[i] == num_tokens:
            self._timings[i].append(seconds)
            self.seconds[i] = statistics.median_low(self._timings[i])
            self._counts[i] += 1
            self._timed[i] = self._clock
        elif num_tokens not in self._warmed:
            self._warmed.add(num_tokens)
            return
        else:
            self.tokens.insert(i, num_tokens)
            self.seconds.insert(i, seconds)
            self._timings.insert(i, collections.deque([seconds], maxlen=WINDOW))
            self._counts.insert(i, 1)
            self._timed.insert(i, self._clock)
        fresh = [j for j, timed in enumerate(self._timed) if self._clock - timed <= STALE]
        if len(fresh) < len(self.tokens):
            kept = (self.tokens, self.seconds, self._timings, self._counts, self._timed)
            self.tokens, self.seconds, self._timings, self._counts, self._timed = ([p[j] for j in fresh] for p in kept)
        self._fit()


def expected_tokens(a: float, j: int) -> float:
    """Tokens a row commits in expectation with j drafts, each accepted with probability a after the last."""
    return sum(a**i for i in range(j + 1))


def choose_drafts(
    rates: list[float],
    k_max: int,
    cost: CostModel,
    draft_cost: Callable[[int], float],
    pinned: list[bool] | None = None,
    overhead: float = 0.0,
) -> list[int]:
    """The drafts per row (0..k_max) maximising expected committed tokens per second (the module's rule).

    rates: each row's per-position acceptance estimate; draft_cost: the draft's seconds in a step by the most
    drafts any row verifies (0: no row drafts; :meth:`AdaptivePolicy.draft_seconds`); pinned: rows that verify
    k_max drafts whatever the rule says (their cost and gain still count); overhead: a step's seconds besides
    its verify and proposal (the module's ``o``)."""
    rows = len(rates)
    pinned = pinned or [False] * rows
    if rows == 0 or k_max == 0:
        return [0] * rows
    free = [b for b in range(rows) if not pinned[b]]
    forced = k_max * (rows - len(free))
    base = sum(expected_tokens(a, k_max) if p else 1.0 for a, p in zip(rates, pinned))
    marginals = sorted(((rates[b] ** j, j, b) for b in free for j in range(1, k_max + 1)), reverse=True)
    verify = [cost(rows + forced + m) + overhead for m in range(len(marginals) + 1)]  # seconds by drafts verified
    propose = [draft_cost(j) for j in range(k_max + 1)]  # by the most a row drafts
    best, best_cap, best_m = -1.0, 0, 0
    for cap in [k_max] if forced else range(k_max + 1):  # a pinned row makes the draft run k_max passes anyway
        gains = [gain for gain, j, _ in marginals if j <= cap and gain > 0.0]
        gained = base
        for m in range(len(gains) + 1):
            gained += gains[m - 1] if m else 0.0
            value = gained / (verify[m] + propose[cap if m or forced else 0])
            if value > best:
                best, best_cap, best_m = value, cap, m
    counts = [k_max if p else 0 for p in pinned]
    for _, _, b in [entry for entry in marginals if entry[1] <= best_cap][:best_m]:
        counts[b] += 1
    return counts


def draft_passes(most_drafts: int, draft_always: bool) -> int:
    """The chained passes a proposal runs when the row that drafts most drafts `most_drafts`: at least the first
    one for a draft that runs every step (`AdaptivePolicy.draft_always`), none for others when no row drafts."""
    return max(most_drafts, 1) if draft_always else most_drafts


def forced_extension(
    probs: list[list[float]],
    runs: list[int],
    cost: CostModel,
    draft_cost: float,
    pinned: list[bool],
    overhead: float = 0.0,
) -> list[bool]:
    """Which rows verify their forced run after their drafts (the module's rule).

    probs: each row's acceptance probability per chosen draft (1.0 where forced); runs: the forced tokens
    that could follow them; draft_cost: seconds of this step's proposal (0 when none runs), overhead: the
    step's other seconds (`choose_drafts`); pinned rows verify their run whatever it costs."""
    reach = [math.prod(p) for p in probs]
    gained = sum(1.0 + sum(itertools.accumulate(p, operator.mul)) for p in probs)
    tokens = sum(len(p) + 1 for p in probs)
    include = [pin and run > 0 for pin, run in zip(pinned, runs)]
    for b in range(len(probs)):
        if include[b]:
            gained, tokens = gained + runs[b] * reach[b], tokens + runs[b]
    for b in sorted((b for b in range(len(probs)) if runs[b] > 0 and not pinned[b]), key=lambda b: -reach[b]):
        more, wider = gained + runs[b] * reach[b], tokens + runs[b]
        fixed = draft_cost + overhead
        if more / (cost(wider) + fixed) > gained / (cost(tokens) + fixed):
            include[b], gained, tokens = True, more, wider
    return include


@dataclass
class RowEstimate:
    accepted: float = 0.0  # discounted accepted positions
    tried: float = 0.0  # discounted tried positions
    idle: int = 0  # consecutive steps without drafts


@dataclass
class AdaptivePolicy:
    """Per-row acceptance estimates and the choice of each step's drafts (module docstring)."""

    k_max: int
    cost: CostModel
    draft_always: bool  # the draft runs its first pass every step anyway (the ranks run it: the module's docstring)
    prior: float = 0.5  # a0: the acceptance rate a new row starts from
    prior_weight: float = 2.0  # w: in tried positions
    decay: float = 0.9  # weight of the past per update
    probe_every: int = 8  # a row without drafts for this many steps drafts one
    draft_cost: CostModel = field(default_factory=lambda: CostModel([], []))  # a proposal's seconds by its passes
    overheads: collections.deque = field(default_factory=lambda: collections.deque(maxlen=WINDOW))  # o's timings
    rows: dict[str, RowEstimate] = field(default_factory=dict)
    overall: RowEstimate = field(default_factory=RowEstimate)  # every row's outcomes (decay 0.99): the prior
    chosen: collections.Counter = field(default_factory=collections.Counter)  # k -> row-steps

    def prior_rate(self) -> float:
        """A row's starting estimate: the draft's recent acceptance over all rows (`prior` before any)."""
        o = self.overall
        return (o.accepted + self.prior) / (o.tried + 1.0)

    def rate(self, request_id: str) -> float:
        prior = self.prior_rate()
        e = self.rows.get(request_id)
        if e is None:
            return prior
        return (e.accepted + self.prior_weight * prior) / (e.tried + self.prior_weight)

    def observe(self, request_id: str, drafted: int, accepted: int, asked: int = 0) -> None:
        """A commit's outcome for a row that verified `drafted` drafts and accepted `accepted`, of `asked` the
        policy asked the draft for. A draft with fewer proposals than asked (an n-gram without a match) failed
        at the first position it left empty, if the row reached it: a row's rate is what asking it yields, so a
        draft that rarely has a proposal is rarely asked, though its proposals, when there, are good."""
        e = self.rows.setdefault(request_id, RowEstimate())
        missed = drafted < asked and accepted == drafted
        if drafted == 0 and not missed:
            e.idle += 1
            return
        e.idle = 0
        tried = min(accepted + 1, drafted) + missed
        e.accepted = self.decay * e.accepted + accepted
        e.tried = self.decay * e.tried + tried
        self.overall.accepted = 0.99 * self.overall.accepted + accepted
        self.overall.tried = 0.99 * self.overall.tried + tried

    def observe_draft_time(self, seconds: float, passes: int) -> None:
        """A proposal's measured time over `passes` chained passes."""
        self.draft_cost.observe(passes, seconds)

    def observe_overhead(self, seconds: float) -> None:
        """A step's period less its verify's and its proposal's timed seconds (the module's ``o``)."""
        self.overheads.append(seconds)

    def overhead(self) -> float:
        """The module's ``o``: the median of the recent :meth:`observe_overhead` timings (0 before any)."""
        return statistics.median_low(self.overheads) if self.overheads else 0.0

    def draft_seconds(self, most_drafts: int) -> float:
        """The draft's expected time in a step where the row that drafts most drafts `most_drafts`: a proposal of
        :func:`draft_passes` chained passes, 0 for none. 0 before any timing: the policy then tries drafting, and
        so times it. With one proposal length timed, a longer one costs what it does: read in proportion, it would
        pay for the first pass (the dearest: it takes the committed tokens) once per pass, and the policy would
        never try the longer proposal, so never time it; assumed no dearer, it is tried where the acceptance pays
        for it, and so timed."""
        passes = draft_passes(most_drafts, self.draft_always)
        if not passes:
            return 0.0
        timed = self.draft_cost.tokens
        return self.draft_cost(timed[0] if len(timed) == 1 and passes > timed[0] else passes)

    def forced_runs(
        self, request_ids: list[str], forced: list[list[bool]], runs: list[int], pinned: list[bool], draft_cost: float
    ) -> list[bool]:
        """Whether each row verifies its forced run of `runs[b]` tokens after its drafts (`forced[b]`: which of
        them are forced), by `forced_extension`."""
        probs = [[1.0 if f else self.rate(r) for f in row] for r, row in zip(request_ids, forced)]
        return forced_extension(probs, runs, self.cost, draft_cost, pinned, self.overhead())

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def choose(self, request_ids: list[str], pinned: list[bool] | None = None) -> list[int]:
        """Each row's drafts for its next verify (0..k_max), probes included; counted in `chosen`.
        `pinned` rows keep k_max (sampled rows: see the module docstring)."""
        rates = [self.rate(r) for r in request_ids]
        counts = choose_drafts(rates, self.k_max, self.cost, self.draft_seconds, pinned, self.overhead())
        for b, r in enumerate(request_ids):
            e = self.rows.get(r)
            if counts[b] == 0 and e is not None and e.idle + 1 >= self.probe_every:
                counts[b] = 1
        self.chosen.update(counts)
        return counts
