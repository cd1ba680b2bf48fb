"""The engine: requests, continuous batching and the unified speculative step.

One `step()` runs, for every running row (DESIGN.md, "The speculative step"):

1. merge   per row, the tokens to verify: a new row feeds its whole prompt (no drafts); a
           running row feeds [t_last, d_0 .. d_{k_b-1}] at positions L-1 .. L-1+k_b
2. verify  one ragged target forward; logits at each row's k_b+1 verify positions
3. masks   per-position grammar bitmasks and thinking phases for the draft window: the ones the
           draft's grammar walk built for these very drafts (step 6 of the previous step), else
           built on a worker thread while the target runs (`MaskPipeline`)
4. accept  `decoding.accept`; rows with k_b < k pad their drafts with -1 (a plain step there);
           penalties and logit biases first adjust the logits of the rows that ask for them
5. commit  accepted drafts + the emitted token, cut by max_tokens / EOS / stop strings /
           grammar termination; KV caches truncated to the committed length
6. propose the draft reads the target's hidden states at the committed positions; rows with a
           grammar draft under it (a `MaskWalk` tells the draft which tokens each position allows),
           rows with penalties or logit biases draft with them applied

Cache invariant: a row's target KV cache holds positions 0 .. len(tokens) - 2; its last
committed token is always fed again as t_last by the next step.

Threads: on the CPU a step of at most `SMALL_STEP_TOKENS` tokens (decode, verify, drafting) runs
with `EngineConfig.small_step_threads` torch threads, one by default; longer steps (prefills) keep
torch's own setting. A small model's short step is op overhead, which thread hand-offs only add to
(the DeepSeek demo's five-token verify: 5.37 ms on one thread, 5.88 on two), while a prefill
spreads well (180 tokens: 0.65-0.68x the one-thread time on two).

Device reads: a step reads results back from the device twice, by design, each one read for
every row: at commit (the acceptance result) and after propose (the drafts, which the next masks
need). A grammar row's draft adds one read per drafted position (its matcher runs on the host),
and `logprobs` one at commit. Batches carry their rows' spans as Python ints and caches keep their
lengths on the host, so no forward reads the device back (`tests/models/test_host_planning.py`
runs the providers on the meta device to hold that), and every host-to-device copy goes through
pinned memory without waiting (`tandem.transfer`; `tests/engine/test_device_reads.py` counts the
reads of a step on CUDA).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from dataclasses import dataclass, field

import torch

from tandem.decoding.acceptance import AcceptanceResult, accept
from tandem.decoding.logprobs import TokenLogprob, token_logprobs
from tandem.decoding.output import RequestOutput, StreamDelta, TextAssembler
from tandem.decoding.params import RelaxedAcceptance, SamplingParams, SamplingTensors, batch_sampling
from tandem.decoding.penalties import LogitAdjustments
from tandem.decoding.rng import derive_seeds
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID, sample
from tandem.grammars.compiler import CompileJob, GrammarCompiler
from tandem.grammars.errors import GrammarError
from tandem.grammars.masks import MaskWalk, SpeculativeMasker
from tandem.grammars.overlap import MaskHandle, MaskPipeline
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.tokenizer import GrammarTokenizer
from tandem.grammars.thinking import ThinkingMarkers, ThinkingTracker
from tandem.models.base import DraftInput, ForwardBatch, RowSpans
from tandem.transfer import int64_tensor, to_device

SMALL_STEP_TOKENS = 16  # a step of at most this many tokens runs on `EngineConfig.small_step_threads`


class PromptTooLongError(ValueError):
    """A prompt that leaves no room to generate within the engine's context length."""


@dataclass
class EngineConfig:
    num_speculative_tokens: int = 4
    max_num_seqs: int = 8  # rows decoded together; also the number of KV-cache slots
    max_model_len: int = 1024  # tokens per row (prompt + generated), the size of one slot
    relaxed: RelaxedAcceptance | None = None  # relaxed acceptance inside <think>…</think>
    grammar_backend: str = "auto"  # xgrammar | llguidance | outlines | auto
    grammar_timeout_s: float = 30.0  # a grammar still compiling after this fails its request
    small_step_threads: int | None = 1  # CPU torch threads for steps of few tokens (None: torch's setting)


@dataclass
class _Request:
    """Engine-side state of one request."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    text: TextAssembler
    grammar_job: CompileJob | None = None  # the request's grammar, compiling off the step loop
    tokens: list[int] = field(default_factory=list)  # prompt + committed output
    drafts: list[int] = field(default_factory=list)  # pending drafts for the next verify
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] or None (deterministic)
    # The drafts' verify masks from the draft's grammar walk: (bitmask [k+1, W], in_thinking [k+1])
    walked_masks: tuple[torch.Tensor, torch.Tensor] | None = None
    slot: int = -1
    output: RequestOutput | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def is_new(self) -> bool:
        return self.num_generated == 0


class Engine:
    """Continuous-batching speculative engine over one target and an optional draft.

    `draft=None` is the plain path: the same step with k = 0.
    """

    def __init__(self, target, draft, tokenizer, config: EngineConfig) -> None:
        self.target, self.draft, self.tokenizer, self.config = target, draft, tokenizer, config
        self.k = config.num_speculative_tokens if draft is not None else 0
        self.grammar_tokenizer = GrammarTokenizer(tokenizer, target.vocab_size)
        self.compiler = GrammarCompiler(timeout_s=config.grammar_timeout_s)
        self._eos = _eos_ids(tokenizer)
        self.masker = SpeculativeMasker(target.vocab_size, len(tokenizer), end_token_ids=sorted(self._eos))
        self.device = next(iter(target.parameters())).device if hasattr(target, "parameters") else torch.device("cpu")
        self.mask_pipeline = MaskPipeline(self.masker, config.max_num_seqs, self.k, self.device)
        # Scratch for grammar-aware drafting; each row keeps a copy of its own for the next verify.
        self._draft_bitmask = torch.zeros(config.max_num_seqs, self.k + 1, self.masker.width, dtype=torch.int32)
        self._draft_thinking = torch.zeros(config.max_num_seqs, self.k + 1, dtype=torch.bool)
        self.target_cache = target.new_cache(config.max_num_seqs, config.max_model_len)
        self.draft_cache = draft.new_cache(config.max_num_seqs, config.max_model_len) if draft is not None else None
        self._free_slots = list(range(config.max_num_seqs))
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._finished: dict[str, RequestOutput] = {}
        self._ids = itertools.count()
        self._markers = _thinking_markers(tokenizer)

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request. Nothing is queued when it raises: PromptTooLongError if the prompt cannot fit,
        ValueError for an empty prompt or a token id (prompt or logit bias) outside the vocabulary."""
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        room = self.config.max_model_len - len(prompt) - self.k - 1
        if room < 1:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens; the context is {self.config.max_model_len} tokens "
                f"({self.k + 1} reserved for speculation), so nothing can be generated")
        vocab_size = self.target.vocab_size
        for what, ids in (("prompt", prompt), ("SamplingParams.logit_bias", params.logit_bias or {})):
            outside = next((i for i in ids if not 0 <= i < vocab_size), None)
            if outside is not None:
                raise ValueError(f"{what}: token id {outside} is outside the vocabulary [0, {vocab_size})")
        request_id = request_id or f"req-{next(self._ids)}"
        request = _Request(
            request_id=request_id,
            prompt=list(prompt),
            params=params,
            seed=params.seed if params.seed is not None else random.getrandbits(62),
            text=TextAssembler(self.tokenizer, eos_token_ids=self._eos | set(params.stop_token_ids or ()),
                               tracker=self._tracker(prompt),
                               stop=params.stop_strings),
            grammar_job=self.compile_grammar(params),
            tokens=list(prompt),
        )
        request.output = RequestOutput(request_id=request_id, prompt_token_ids=list(prompt),
                                       logprobs=None if params.logprobs is None else [])
        self._waiting.append(request)
        return request_id

    def compile_grammar(self, params: SamplingParams) -> CompileJob | None:
        """Start compiling the request's grammar (cached); raises InvalidGrammarSpec at once for a bad spec."""
        spec = grammar_spec(params)
        return None if spec is None else self.compiler.submit(spec, self.grammar_tokenizer, self.config.grammar_backend)

    def _tracker(self, prompt: list[int]) -> ThinkingTracker | None:
        return None if self._markers is None else ThinkingTracker(self._markers, prompt)

    def abort(self, request_id: str) -> None:
        """Drop a request, waiting or running; its slot is free for the next step."""
        for queue in (self._waiting, self._running):
            for request in queue:
                if request.request_id == request_id:
                    self._finish(request, "abort")
                    queue.remove(request)
                    return

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def step(self) -> list[StreamDelta]:
        """One unified step over all running rows; returns what each touched request gained."""
        self._admit()
        rows = list(self._running)
        if not rows:
            if self._waiting:  # only grammars still compiling: yield the CPU to their workers
                time.sleep(0.001)
            return []
        batch = self._merge(rows)
        with torch_threads(self._threads_for(batch)):
            return self._run_step(rows, batch)

    def _threads_for(self, batch: ForwardBatch) -> int | None:
        """The torch threads a step over `batch` runs with (None: torch's setting)."""
        if self.device.type == "cpu" and batch.num_tokens <= SMALL_STEP_TOKENS:
            return self.config.small_step_threads
        return None

    def _run_step(self, rows: list[_Request], batch: ForwardBatch) -> list[StreamDelta]:
        """Steps 2-6 of the module docstring over `rows`, merged into `batch`."""
        k = self.k
        padded = [t for r in rows for t in [*r.drafts, *[PLACEHOLDER_TOKEN_ID] * (k - len(r.drafts))]]
        drafts = int64_tensor(padded).view(len(rows), k)  # [B, k]
        masks = self._submit_masks(rows, drafts)
        want_hidden = self.draft is not None and self.draft.hidden_kind is not None
        out = self.target.forward(batch, self.target_cache,
                                  return_hidden=want_hidden and self.draft.hidden_kind == "last",
                                  return_aux=want_hidden and self.draft.hidden_kind == "aux")
        logits = out.logits.view(len(rows), k + 1, -1)
        drafts = to_device(drafts, logits.device)
        scores = self._adjusted(rows, logits, drafts)
        bitmask, in_thinking = self._wait_masks(masks)
        sampling = self._sampling(rows, logits.device)
        if k == 0:  # the plain path: `sample` is `accept` without drafts, minus the verification work
            result = AcceptanceResult.without_drafts(
                sample(scores[:, 0], sampling, None if bitmask is None else bitmask[:, 0]))
        else:
            result = accept(
                scores, drafts,
                draft_probs=self._draft_probs(rows, logits.shape[-1]),
                sampling=sampling,
                bitmask=bitmask,
                in_thinking=in_thinking,
                relaxed=self.config.relaxed,
            )
        deltas = self._commit(rows, result, logits)
        if self.draft is not None:
            self._propose([r for r in rows if r.output.finish_reason is None], rows, out, batch)
        return deltas

    def _admit(self) -> None:
        """Move waiting requests whose grammar is ready into free slots, in arrival order
        (a request still compiling does not hold back the ones behind it)."""
        for request in list(self._waiting):
            if not self._free_slots:
                return
            job = request.grammar_job
            if job is not None and not job.done():
                continue
            self._waiting.remove(request)
            try:
                matcher = None if job is None else job.result().new_matcher()
            except GrammarError as error:
                request.output.error = str(error)
                request.output.finish_reason = "error"
                self._finished[request.request_id] = request.output
                continue
            self.masker.add_row(request.request_id, matcher, self._tracker(request.prompt))
            request.slot = self._free_slots.pop(0)
            self.target_cache.reset([request.slot])
            self._running.append(request)

    def _merge(self, rows: list[_Request]) -> ForwardBatch:
        """The ragged verify batch; its logits indices keep ``k + 1`` rows per request (``[B * (k+1)]``)."""
        ids, starts, lengths, logit_index = [], [], [], []
        for r in rows:
            if r.is_new:
                feed, start = r.tokens, 0
            else:
                feed, start = [r.tokens[-1], *r.drafts], len(r.tokens) - 1
            first_logit = len(ids) + len(feed) - 1 - len(r.drafts)  # the position of t_last
            logit_index.extend(first_logit + min(j, len(r.drafts)) for j in range(self.k + 1))
            ids.extend(feed)
            starts.append(start)
            lengths.append(len(feed))
        device = self.device
        spans = RowSpans(starts, lengths, [r.slot for r in rows])
        return ForwardBatch.build(int64_tensor(ids, device), spans, logits_indices=int64_tensor(logit_index, device))

    def _submit_masks(self, rows: list[_Request], drafts: torch.Tensor) -> tuple[MaskHandle, bool] | None:
        """Start building this step's masks (drafts [B, k] CPU) on the pipeline's worker; None when no
        row has a grammar and relaxed acceptance is off. Returns (handle, whether any row has a grammar)."""
        any_grammar = self._any_grammar(rows)
        if not any_grammar and (self.config.relaxed is None or self._markers is None):
            return None
        if all(r.walked_masks is not None for r in rows):  # built while drafting: `fill` is that same walk
            bitmask, in_thinking = (torch.stack(masks) for masks in zip(*(r.walked_masks for r in rows)))
            return MaskHandle.ready(bitmask, in_thinking, self.device), any_grammar
        return self.mask_pipeline.submit([r.request_id for r in rows], drafts), any_grammar

    def _any_grammar(self, rows: list[_Request]) -> bool:
        return any(self.masker.row(r.request_id).matcher is not None for r in rows)

    def _wait_masks(self, masks: tuple[MaskHandle, bool] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Grammar bitmasks [B, k+1, W] (None when no row has a grammar) and thinking phases [B, k+1]
        (None when relaxed acceptance is off), on the device."""
        if masks is None:
            return None, None
        handle, any_grammar = masks
        bitmask, in_thinking, _ = handle.wait()
        return bitmask if any_grammar else None, in_thinking if self.config.relaxed is not None else None

    @staticmethod
    def _adjustments(rows: list[_Request], vocab_size: int, device: torch.device) -> LogitAdjustments | None:
        """The rows' penalties and logit biases over their committed output (`decoding.penalties`);
        None when no row asks for any (such steps pay nothing)."""
        if not any(r.params.adjusts_logits for r in rows):
            return None
        return LogitAdjustments.build([r.params for r in rows], [r.prompt for r in rows],
                                      [r.tokens[len(r.prompt):] for r in rows], vocab_size, device)

    def _adjusted(self, rows: list[_Request], logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The logits [B, k+1, V] with each row's adjustments applied; the model's own when none."""
        adjustments = self._adjustments(rows, logits.shape[-1], logits.device)
        return logits if adjustments is None else adjustments.apply(logits, drafts)

    @staticmethod
    def _sampling(rows: list[_Request], device: torch.device) -> SamplingTensors | None:
        """This step's per-row settings, or None when every row is greedy (no seeds needed)."""
        if all(r.params.temperature == 0 for r in rows):
            return None
        seeds = derive_seeds(torch.tensor([r.seed for r in rows]), torch.tensor([r.num_generated for r in rows]))
        return batch_sampling([r.params for r in rows], seeds, device)

    def _draft_probs(self, rows, vocab_size):
        if all(r.draft_probs is None for r in rows):
            return None
        probs = torch.zeros(len(rows), self.k, vocab_size, device=self.device)
        for b, r in enumerate(rows):
            if r.draft_probs is not None:
                probs[b, : len(r.drafts)] = r.draft_probs
        return probs

    def _commit(self, rows: list[_Request], result: AcceptanceResult, logits: torch.Tensor) -> list[StreamDelta]:
        """Append each row's emitted tokens (logits [B, k+1, V]: the positions that emitted them)."""
        deltas = []
        for b, (r, (emitted_all, num_accepted, dead_end)) in enumerate(zip(rows, result.to_host())):
            remaining = r.params.max_tokens - r.num_generated
            emitted = emitted_all[:remaining]
            consumed = r.text.add(emitted)
            emitted = emitted[:consumed]
            self.masker.commit(r.request_id, emitted)
            r.tokens.extend(emitted)
            stats = r.output.stats
            stats.steps += 1
            stats.drafted += len(r.drafts)
            stats.accepted += min(num_accepted, len(emitted))
            r.drafts, r.draft_probs, r.walked_masks = [], None, None
            self.target_cache.truncate([r.slot], [len(r.tokens) - 1])
            reason = None
            if r.text.stopped_by is not None or self.masker.is_terminated(r.request_id):
                reason = "stop"
            elif dead_end and consumed == len(emitted_all):
                reason = "grammar_dead_end"
            elif r.num_generated >= r.params.max_tokens or len(r.tokens) + self.k + 1 > self.config.max_model_len:
                reason = "length"
            logprobs = None if r.params.logprobs is None else token_logprobs(
                logits[b, : len(emitted)], emitted, r.params.logprobs)
            deltas.append(self._delta(r, emitted, logprobs, reason))
            if reason is not None:
                self._finish(r, reason)
                self._running.remove(r)
        return deltas

    def _propose(self, live: list[_Request], rows: list[_Request], out, batch: ForwardBatch) -> None:
        """Give each live row's newly committed tokens and their hidden states to the draft."""
        if not live:
            return
        index = {id(r): b for b, r in enumerate(rows)}
        hidden_all = out.hidden if self.draft.hidden_kind == "last" else out.aux_hidden
        offsets = batch.spans.offsets()
        ids, starts, lengths, hidden_rows, histories = [], [], [], [], []
        for r in live:
            b = index[id(r)]
            start = batch.spans.starts[b] + 1
            new_tokens = r.tokens[start:]  # paired with the hidden state before each
            ids.extend(new_tokens)
            starts.append(start)
            lengths.append(len(new_tokens))
            hidden_rows.extend(range(offsets[b], offsets[b] + len(new_tokens)))
            histories.append(int64_tensor(r.tokens))
        device = self.device
        spans = RowSpans(starts, lengths, [r.slot for r in live])
        draft_batch = ForwardBatch.build(int64_tensor(ids, device), spans)
        hidden = None if hidden_all is None else hidden_all[int64_tensor(hidden_rows, device)]
        if self.draft_cache is not None:
            self.draft_cache.truncate(spans.slots, spans.starts)
        adjustments = self._adjustments(live, self.target.vocab_size, device) if self.draft.follows_constraint else None
        walk = None
        if self.draft.follows_constraint and self._any_grammar(live):
            walk = MaskWalk(self.masker, [r.request_id for r in live], self.k, self._draft_bitmask,
                            self._draft_thinking, device)
        try:
            proposal = self.draft.propose(
                DraftInput(draft_batch, hidden, histories, constraint=walk,
                           adjust=None if adjustments is None else adjustments.apply_after), self.draft_cache, self.k)
        finally:
            if walk is not None:
                walk.finish()
        proposed = proposal.tokens.tolist()  # one read of the device for every row
        for b, r in enumerate(live):
            budget = min(r.params.max_tokens - r.num_generated - 1, self.config.max_model_len - len(r.tokens) - 1, self.k)
            drafts = proposed[b][: max(budget, 0)]
            if PLACEHOLDER_TOKEN_ID in drafts:  # a draft with fewer proposals (n-gram miss)
                drafts = drafts[: drafts.index(PLACEHOLDER_TOKEN_ID)]
            r.drafts = drafts
            r.draft_probs = None if proposal.probs is None else proposal.probs[b, : len(drafts)]
            if walk is not None and len(drafts) == self.k:  # the walk went through exactly these drafts
                r.walked_masks = walk.bitmask[b].clone(), walk.in_thinking[b].clone()

    # ---------------------------------------------------------------- outputs
    def _delta(self, r: _Request, emitted: list[int], logprobs: list[TokenLogprob] | None,
               reason: str | None) -> StreamDelta:
        reasoning, text = r.text.streamable() if reason is None else (r.text.reasoning, r.text.text)
        out = r.output
        delta = StreamDelta(r.request_id, text=text[len(out.text):], reasoning=reasoning[len(out.reasoning):],
                            token_ids=emitted, finish_reason=reason, logprobs=logprobs)
        out.text, out.reasoning = text, reasoning
        out.token_ids.extend(emitted)
        if logprobs is not None:
            out.logprobs.extend(logprobs)
        return delta

    def _finish(self, r: _Request, reason: str) -> None:
        r.output.finish_reason = reason
        r.output.text, r.output.reasoning = r.text.text, r.text.reasoning
        self._finished[r.request_id] = r.output
        if r.slot >= 0:
            self.masker.remove_row(r.request_id)
            self._free_slots.append(r.slot)
            r.slot = -1

    def pop_finished(self, request_id: str) -> RequestOutput | None:
        """The output of a finished request, handed over once (None while it runs)."""
        return self._finished.pop(request_id, None)


@contextlib.contextmanager
def torch_threads(num_threads: int | None):
    """Run the block with `num_threads` torch intra-op threads, then restore the setting (None: unchanged)."""
    previous = torch.get_num_threads()
    if num_threads is None or num_threads == previous:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The request's constraint as a GrammarSpec; `grammar` is GBNF/EBNF if it has `::=`, else Lark."""
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.choice is not None:
        return GrammarSpec.choice(params.choice)
    if params.grammar is not None:
        return GrammarSpec.ebnf(params.grammar) if "::=" in params.grammar else GrammarSpec.lark(params.grammar)
    return None


def _eos_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation_eos = getattr(getattr(tokenizer, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    return ids


def _thinking_markers(tokenizer) -> ThinkingMarkers | None:
    """The tokenizer's `<think>` / `</think>` ids, or None if it has no such single tokens."""
    try:
        return ThinkingMarkers.from_tokenizer(tokenizer)
    except ValueError:
        return None
