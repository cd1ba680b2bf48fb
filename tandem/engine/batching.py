"""The step's batches, built from its rows on the host: the ragged verify batch (step 1, merge) and
the draft's input (step 6, propose).

Spans are Python ints and ids cross to the device through `int64_tensor` (pinned, no wait), so
building a batch never reads the device.
"""

from __future__ import annotations

import torch

from tandem.core.transfer import int64_tensor
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID
from tandem.engine.request import Request
from tandem.models.base import ForwardBatch, RowSpans


def padded_drafts(rows: list[Request], k: int) -> torch.Tensor:
    """The rows' pending drafts as ``[B, w]`` int64 on the host, ``w = max(k, longest row's drafts)`` (grammar-
    forced drafts may go past k); a row with fewer pads them with PLACEHOLDER_TOKEN_ID (a plain step past its
    drafts)."""
    width = max([k, *(len(r.drafts) for r in rows)])
    padded = [t for r in rows for t in [*r.drafts, *[PLACEHOLDER_TOKEN_ID] * (width - len(r.drafts))]]
    return int64_tensor(padded).view(len(rows), width)


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


def verify_batch(
    rows: list[Request], k: int, held: list[int], device: torch.device, ends: list[int | None] | None = None
) -> ForwardBatch:
    """The ragged verify batch; its logits indices keep ``k + 1`` rows per request (``[B * (k+1)]``).

    Row ``b`` feeds its tokens from position ``held[b]`` (what its target cache holds) and its drafts: a
    running row ``[t_last, *drafts]`` from ``len(tokens) - 1``; a new row its whole prompt, or what follows a
    reused prefix; a preempted row its prompt and generated tokens again; a row prefilled in chunks only its
    tokens up to ``ends[b]`` (None: all). A row with fewer than k drafts repeats its last verify position's
    index to fill its k + 1.
    """
    ids, lengths, logit_index = [], [], []
    for r, start, end in zip(rows, held, ends or [None] * len(rows)):
        feed = [*r.tokens[start:end], *r.drafts]
        first_logit = len(ids) + len(feed) - 1 - len(r.drafts)  # the position of t_last
        logit_index.extend(first_logit + min(j, len(r.drafts)) for j in range(k + 1))
        ids.extend(feed)
        lengths.append(len(feed))
    spans = RowSpans(list(held), lengths, [r.slot for r in rows])
    return ForwardBatch.build(int64_tensor(ids, device), spans, logits_indices=int64_tensor(logit_index, device))


def draft_batch(
    live: list[Request],
    rows: list[Request],
    verify: ForwardBatch,
    hidden_all: torch.Tensor | None,
    device: torch.device,
) -> tuple[ForwardBatch, torch.Tensor | None, list[torch.Tensor]]:
    """What the draft reads after a commit, for the `live` rows among the verified `rows`:

    - the batch of each row's newly committed tokens, from the position after the verify's first (a prefill
      chunk's: those after each of its positions);
    - the target's hidden states (``hidden_all``, the verify's, or None) at the position before each
      of those tokens;
    - each row's whole history of tokens (on the host: n-gram lookup).
    """
    index = {id(r): b for b, r in enumerate(rows)}
    offsets = verify.spans.offsets()
    ids, starts, lengths, hidden_rows, histories = [], [], [], [], []
    for r in live:
        b = index[id(r)]
        start = verify.spans.starts[b] + 1
        new_tokens = r.tokens[start : start + verify.spans.lengths[b]]  # paired with the hidden state before each
        ids.extend(new_tokens)
        starts.append(start)
        lengths.append(len(new_tokens))
        hidden_rows.extend(range(offsets[b], offsets[b] + len(new_tokens)))
        histories.append(int64_tensor(r.tokens))
    spans = RowSpans(starts, lengths, [r.slot for r in live])
    batch = ForwardBatch.build(int64_tensor(ids, device), spans)
    hidden = None if hidden_all is None else hidden_all[int64_tensor(hidden_rows, device)]
    return batch, hidden, histories
