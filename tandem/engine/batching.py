"""The step's batches, built from its rows on the host: the verify step's inputs (step 1, merge) and the
draft's (step 6, propose).

Spans are Python ints, so building a batch never reads the device, and each phase's host values (the batch,
the forwards' plans: the graph runner's or the eager layouts', the drafts, the penalties' entries, the sampling
tables) cross to the device in one staged copy (`tandem.core.transfer.Staging`): a step copies to the device
twice, once before the verify and once before the proposal, whether its rows sample or not, eager or compiled; once
when the proposal is a lookahead (`Lookahead`: its first pass is planned with the verify).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tandem.core.transfer import Staging, int64_tensor
from tandem.decoding.params import SamplingTensors
from tandem.decoding.penalties import LogitAdjustments
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID
from tandem.engine import sampling
from tandem.engine.graphs import GraphRunner
from tandem.engine.request import Request, Undrafted
from tandem.models.attention import RaggedLayout
from tandem.models.base import ForwardBatch, KVCache, RowSpans


@dataclass
class VerifyInputs:
    """What a verify step reads besides the logits, for its B rows of which B' verify (the others prefill a chunk).

    batch:       the ragged verify batch; its logits indices keep ``k + 1`` rows per request (``[B * (k+1)]``)
    verified:    [B'] int64, the rows of ``batch`` that verify; None when all do
    host_drafts: [B', w] int64 on the host (the masks'), ``w = max(k_max, longest row's drafts)`` (grammar-forced
                 drafts may go past k_max); a row with fewer pads them with PLACEHOLDER_TOKEN_ID
    drafts:      [B', k] int64 on the device, the drafts this step verifies
    adjustments: the verifying rows' penalties and logit biases (None: no row has any)
    sampling:    the verifying rows' sampling settings with this step's seeds (None: every row is greedy)
    lookahead:   the draft's first pass of a lookahead proposal over the verify's emitted tokens (None: none)
    """

    batch: ForwardBatch
    verified: torch.Tensor | None
    host_drafts: torch.Tensor
    drafts: torch.Tensor
    adjustments: LogitAdjustments | None
    sampling: SamplingTensors | None
    lookahead: Lookahead | None = None


@dataclass
class Lookahead:
    """A lookahead proposal's first pass (`Engine._lookahead`), planned with the verify: row b, which verified its
    last token at position p and m drafts, feeds the draft the m + 1 tokens emitted at positions p + 1 .. p + m + 1
    (correct up to its accepted drafts and the token after them; the rest are rewritten later), each paired with the
    verify's hidden state before it.

    batch: the draft's batch over those positions, its ``input_ids`` a placeholder (:meth:`over`)
    index: [T] int64, each of its tokens' place among the verify's ``[B * (k+1)]`` outputs; None: all, in order
    """

    batch: ForwardBatch
    index: torch.Tensor | None

    def over(self, emitted: torch.Tensor) -> ForwardBatch:
        """The first pass's batch over ``emitted [B, k+1]`` int64, each verified position's token."""
        ids = emitted.flatten()
        return replace(self.batch, input_ids=ids if self.index is None else ids[self.index])


def verify_inputs(
    rows: list[Request],
    k: int,
    k_max: int,
    held: list[int],
    device: torch.device,
    ends: list[int | None] | None = None,
    *,
    vocab_size: int,
    runner: GraphRunner | None = None,
    cache: KVCache | None = None,
    adjust: bool = True,
    lookahead: RowSpans | None = None,
) -> VerifyInputs:
    """The verify step's inputs, in one copy with the plan of the graph runner's forward (graph mode's ``runner``),
    else with the eager forward's layout over ``cache`` (the target's; `RaggedLayout.stage`). ``adjust=False``
    leaves the penalties out (``adjustments`` None): async scheduling builds them once the rows' tokens are known.
    ``lookahead``: the rows of a lookahead proposal's first pass (`Lookahead`; graph mode), planned in the same copy.

    Row ``b`` feeds its tokens from position ``held[b]`` (what its target cache holds) and its drafts: a
    running row ``[t_last, *drafts]`` from ``len(tokens) - 1``; a new row its whole prompt, or what follows a
    reused prefix; a preempted row its prompt and generated tokens again; a row prefilled in chunks only its
    tokens up to ``ends[b]`` (None: all; such a row does not verify). A row with fewer than k drafts repeats its
    last verify position's index to fill its k + 1.
    """
    ends = ends or [None] * len(rows)
    ids, lengths, logit_index, draft_starts = [], [], [], []
    for r, start, end in zip(rows, held, ends):
        feed = [*r.tokens[start:end], *r.drafts]
        first_logit = len(ids) + len(feed) - 1 - len(r.drafts)  # the position of t_last
        logit_index.extend(first_logit + min(j, len(r.drafts)) for j in range(k + 1))
        draft_starts.append(first_logit + 1)
        ids.extend(feed)
        lengths.append(len(feed))
    spans = RowSpans(list(held), lengths, [r.slot for r in rows])
    staging = Staging(device)
    batch = ForwardBatch.build(staging.int64(ids), spans, logits_indices=staging.int64(logit_index), staging=staging)
    verified = [b for b, end in enumerate(ends) if end is None]
    full = [rows[b] for b in verified]
    width = max([k_max, *(len(r.drafts) for r in full)])
    padded = [[*r.drafts, *[PLACEHOLDER_TOKEN_ID] * (width - len(r.drafts))] for r in full]
    on_device = _drafts_on_device(full, [draft_starts[b] for b in verified], k, staging)
    inputs = VerifyInputs(
        batch=batch,
        verified=None if len(full) == len(rows) else staging.int64(verified),
        host_drafts=int64_tensor([t for row in padded for t in row]).view(len(full), width),
        drafts=staging.int64([t for row in padded for t in row[:k]]).view(len(full), k),
        adjustments=sampling.adjustments(full, vocab_size, device, staging) if adjust else None,
        sampling=sampling.sampling_tensors(full, device, staging),
        lookahead=None if lookahead is None else _lookahead(lookahead, k, device, staging),
    )
    if runner is not None:
        runner.stage_forward(spans, staging, lookahead)
    elif cache is not None:
        RaggedLayout.stage(spans, cache, staging)
    staging.send()
    for proposal, source, to_ids, to_drafts in on_device:  # the values the placeholders stood for
        values = proposal.view(-1)[source]
        batch.input_ids[to_ids] = values
        inputs.drafts.view(-1)[to_drafts] = values
    return inputs


def _lookahead(spans: RowSpans, k: int, device: torch.device, staging: Staging) -> Lookahead:
    """The `Lookahead` over ``spans`` (row b: its m_b + 1 emitted tokens' positions) after a verify of k + 1
    outputs per row, staged."""
    placeholder = torch.empty(sum(spans.lengths), dtype=torch.int64, device=device)
    index = None
    if any(n != k + 1 for n in spans.lengths):
        index = staging.int64([b * (k + 1) + j for b, n in enumerate(spans.lengths) for j in range(n)])
    return Lookahead(ForwardBatch.build(placeholder, spans, staging=staging), index)


def _drafts_on_device(
    rows: list[Request], starts: list[int], k: int, staging: Staging
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Where the verifying ``rows``' drafts left on the device (``Request.drafts_on_device``) go: per proposal
    tensor ``[B, w]``, the flat indices of the values in it, of their places among the batch's ids (row b's drafts
    from ``starts[b]``) and in the ``drafts [B, k]`` tensor, staged."""
    places: dict[int, tuple[torch.Tensor, list[int], list[int], list[int]]] = {}
    for b, (r, start) in enumerate(zip(rows, starts)):
        if r.drafts_on_device is None:
            continue
        proposal, row = r.drafts_on_device
        _, source, to_ids, to_drafts = places.setdefault(id(proposal), (proposal, [], [], []))
        source.extend(row * proposal.shape[1] + j for j in range(len(r.drafts)))
        to_ids.extend(range(start, start + len(r.drafts)))
        to_drafts.extend(range(b * k, b * k + len(r.drafts)))
    return [(p, *(staging.int64(i) for i in indices)) for p, *indices in places.values()]


def forced_draft_probs(probs: torch.Tensor | None, drafts: list[int], forced: list[bool]) -> torch.Tensor | None:
    """A row's draft distributions ``[len(drafts), V]`` from the proposal's ``probs [k, V]`` (None: deterministic),
    where its forced drafts (``forced``: per draft) are one-hot: the grammar allowed nothing else, and a
    forced draft may replace the proposal's token or follow past its end."""
    if probs is None:
        return None
    out = probs.new_zeros(len(drafts), probs.shape[-1])
    out[: min(len(drafts), len(probs))] = probs[: len(drafts)]
    for i, (token, certain) in enumerate(zip(drafts, forced)):
        if certain:
            out[i].zero_()[token] = 1.0
    return out


def draft_batch(
    live: list[Request],
    rows: list[Request],
    verify: ForwardBatch,
    hidden_all: torch.Tensor | None,
    device: torch.device,
    *,
    runner: GraphRunner | None = None,
    cache: KVCache | None = None,
    num_steps: int = 0,
    vocab_size: int | None = None,
) -> tuple[ForwardBatch, torch.Tensor | None, list[torch.Tensor], LogitAdjustments | None]:
    """What the draft reads after a commit, for the `live` rows among the verified `rows`, in one copy with the
    plans of the graph runner's ``num_steps`` chained draft steps (graph mode's ``runner``), else with the eager
    steps' layouts over ``cache`` (the draft's):

    - the batch of each row's newly committed tokens, from the position after the verify's first (a prefill
      chunk's: those after each of its positions), after those the draft has not taken yet (`Request.undrafted`,
      steps where no row drafted);
    - the target's hidden states (``hidden_all``, the verify's, or None) at the position before each
      of those tokens;
    - each row's whole history of tokens (on the host: n-gram lookup);
    - with ``vocab_size``, the rows' penalties and logit biases over their committed output, which a draft that
      chooses its tokens proposes under (None when no row has any, or without ``vocab_size``).
    """
    committed = _committed(live, rows, verify)
    # The hidden states are rows of `hidden_all` and, for the tokens a row's draft has not taken yet, of its
    # `Undrafted.hidden` (appended after hidden_all's rows): one gather of them all.
    sources = [] if hidden_all is None else [hidden_all]
    kept = 0 if hidden_all is None else len(hidden_all)
    ids, starts, lengths, histories, hidden_rows = [], [], [], [], []
    for r, (start, rows_now) in zip(live, committed):
        behind = _behind(r, start)
        first = start
        if behind is not None and hidden_all is not None:
            first = behind.start
            sources.append(behind.hidden)
            hidden_rows.extend(range(kept, kept + len(behind.hidden)))
            kept += len(behind.hidden)
        hidden_rows.extend(rows_now)
        new_tokens = r.tokens[first : start + len(rows_now)]  # paired with the hidden state before each
        ids.extend(new_tokens)
        starts.append(first)
        lengths.append(len(new_tokens))
        histories.append(int64_tensor(r.tokens))
        r.undrafted = None
    spans = RowSpans(starts, lengths, [r.slot for r in live])
    staging = Staging(device)
    batch = ForwardBatch.build(staging.int64(ids), spans, staging=staging)
    hidden_index = None if hidden_all is None else staging.int64(hidden_rows)
    adjustments = None if vocab_size is None else sampling.adjustments(live, vocab_size, device, staging)
    if runner is not None and num_steps > 0:
        runner.stage_draft(spans, num_steps, staging, by_step=adjustments is not None)
    elif cache is not None and num_steps > 0:
        RaggedLayout.stage(spans, cache, staging, num_steps)
    staging.send()
    hidden = None if hidden_all is None else (torch.cat(sources) if len(sources) > 1 else hidden_all)[hidden_index]
    return batch, hidden, histories, adjustments


def defer_draft(live: list[Request], rows: list[Request], verify: ForwardBatch, hidden_all: torch.Tensor) -> None:
    """Keep, instead of giving them to the draft now, each `live` row's newly committed tokens' hidden states
    (``hidden_all``: the verify's): the next :func:`draft_batch` feeds the draft every token it has not taken, so
    a step where no row drafts costs the draft nothing (`Request.undrafted`)."""
    for r, (start, hidden_rows) in zip(live, _committed(live, rows, verify)):
        behind = _behind(r, start)
        earlier = [] if behind is None else [behind.hidden]
        # A copy (cat makes one even of a single piece): a graph's output is overwritten at its next replay.
        hidden = torch.cat([*earlier, hidden_all[hidden_rows.start : hidden_rows.stop]])
        r.undrafted = Undrafted(start if behind is None else behind.start, hidden)


def _behind(r: Request, start: int) -> Undrafted | None:
    """What `r`'s draft has not taken, when it ends where its tokens committed from `start` begin (else stale: the
    row was preempted and prefills again)."""
    return r.undrafted if r.undrafted is not None and r.undrafted.end == start else None


def _committed(live: list[Request], rows: list[Request], verify: ForwardBatch) -> list[tuple[int, range]]:
    """Each `live` row's newly committed tokens after a verify over `rows`: the position after the verify's first
    (a prefill chunk's: those after each of its positions), and the verify's rows of their hidden states."""
    index = {id(r): b for b, r in enumerate(rows)}
    offsets = verify.spans.offsets()
    out = []
    for r in live:
        b = index[id(r)]
        start = verify.spans.starts[b] + 1
        count = len(r.tokens[start : start + verify.spans.lengths[b]])
        out.append((start, range(offsets[b], offsets[b] + count)))
    return out
