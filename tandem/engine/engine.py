"""The engine: requests, continuous batching and the unified speculative step.

One `step()` runs, for every running row (docs/DESIGN.md, "The speculative step"):

1. merge   per row, the tokens to verify: a new row feeds its whole prompt (no drafts), or its next
           chunk when the step's token budget cannot hold the rest (chunked prefill: nothing is sampled
           for it; the draft fills its cache over the chunk); a running row feeds
           [t_last, d_0 .. d_{k_b-1}] at positions L-1 .. L-1+k_b (`batching.verify_inputs`)
2. verify  one ragged target forward; logits at each row's k_b+1 verify positions
3. masks   per-position grammar bitmasks and thinking phases for the draft window: the ones the
           draft's grammar walk built for these very drafts (step 6 of the previous step), else
           built on a worker thread while the target runs (`masks.StepMasks`, `MaskPipeline`)
4. accept  `decoding.accept`; rows with k_b < k pad their drafts with -1 (a plain step there);
           penalties and logit biases first adjust the logits of the rows that ask for them
           (`sampling`)
5. commit  accepted drafts + the emitted token, cut by max_tokens / EOS / stop strings /
           grammar termination (`stop`); KV caches truncated to the committed length; each row's
           stream delta (`output.stream_delta`); finished rows leave their slots (`scheduler`)
6. propose the draft reads the target's hidden states at the committed positions
           (`batching.draft_batch`); rows with a grammar draft under it (a `MaskWalk` tells the
           draft which tokens each position allows), rows with penalties or logit biases draft
           with them applied

Before the step, `Scheduler.schedule` grows every running row's KV blocks to what the step writes
(preempting the latest admitted rows when the pool runs out) and admits waiting requests whose grammar
has compiled while their blocks fit (`kv_blocks`: a paged cache, one pool of blocks for the target's
and the draft's entries, with automatic prefix caching; one per rank under data-parallel attention), then
hands the rows still prefilling their chunks of the step's token budget (`EngineConfig.max_num_batched_tokens`).
After propose, each live row registers its full committed blocks for reuse and gives back the blocks past its
committed tokens.

Adaptive speculation (`EngineConfig.adaptive`, on by default): before each propose, `adaptive.AdaptivePolicy`
chooses every row's drafts for the next verify (0..k) from its acceptance so far and the verify cost
measured at engine start (`Engine._calibrate`); the draft proposes as far as the row that drafts most and
each row keeps its chosen prefix. The step verifies as many positions per row as the longest row keeps,
and a step where no row keeps any is the plain step (`sample`), with no draft run: a draft without state
needs nothing, and one that reads hidden states takes the step's tokens in its next proposal
(`batching.defer_draft`).

Padded vocabularies: when the model's vocabulary is larger than the tokenizer's, the ids past the
tokenizer are set to -inf in the verify logits and in a grammar-following draft's logits (one fill of
the padded columns, nothing when there are none), for every row, grammar or not.

Cache invariant: a row's target KV cache holds positions 0 .. len(tokens) - 2; its last
committed token is always fed again as t_last by the next step. A new row's cache holds its reused
prefix but its last position, which the prefill runs again (its hidden state is not cached); a
preempted row's holds nothing until it is prefilled again; a row prefilled in chunks holds the chunks fed so far.

Threads: on the CPU a step of at most `SMALL_STEP_TOKENS` tokens (decode, verify, drafting) runs
with `EngineConfig.small_step_threads` torch threads, one by default; longer steps (prefills) keep
torch's own setting. A small model's short step is op overhead, which thread hand-offs only add to
(a short verify of the DeepSeek demo runs faster on one thread than on two), while a prefill has
enough work per op to spread well over several threads.

Device reads: a step reads results back from the device once, by design, one read for every row: at commit
(the acceptance result). A chained draft's proposal stays on the device (`Request.drafts_on_device`: the next verify
takes the values there) unless host work reads it: a grammar row's walk, or the thinking phases relaxed acceptance
reads; then the drafts are a second read after propose. A lookahead proposal (graph mode on CUDA: `_lookahead`, the
draft proposing before the commit) is read with the acceptance result, one read whatever the rows. Drafting under
the grammar pass by pass (eager mode) adds one read per drafted position (its matcher runs on the host), and
`logprobs` one at commit. Batches carry their rows' spans as Python ints and caches keep their lengths on the host,
so no forward reads the device back
(`tests/models/test_host_planning.py` runs the providers on the meta device to hold that), and every host-to-device
copy goes through pinned memory without waiting (`tandem.core.transfer`; `tests/engine/test_device_reads.py` counts
the reads of a step on CUDA). What the verify needs (batch, graph plan, drafts, penalties) and what the proposal needs
each travel in one staged copy (`batching`; sampling tables too), so a step copies to the device twice, greedy or
sampled, once with a lookahead proposal (`tests/engine/test_step_copies.py` counts them).

Async scheduling (`EngineConfig.async_scheduling`, `in_flight`): a plain decode step's forward is launched before
the previous step's tokens are read, fed them on the device; its read then waits for that previous step only, its
commit runs while the device computes, and the step samples after it (a grammar row's mask follows that commit).
By default it is on where it was measured to pay: a plain engine on one CUDA device in graph mode
(`in_flight.resolve_async_scheduling`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.core.transfer import int64_tensor
from tandem.decoding.acceptance import AcceptanceResult, accept, accept_argmax, accepted_counts
from tandem.decoding.logprobs import TokenLogprob, logprob_tensors, token_logprobs
from tandem.decoding.params import RelaxedAcceptance, SamplingParams, SamplingTensors
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID, forbid_ids_from, sample
from tandem.engine import sampling
from tandem.engine.adaptive import AdaptivePolicy, CostModel, draft_passes
from tandem.engine.batching import (
    Lookahead,
    VerifyInputs,
    defer_draft,
    draft_batch,
    forced_draft_probs,
    verify_inputs,
)
from tandem.engine.graphs import GraphRunner, resolve_capture_sizes, resolve_graph_mode, resolve_lookahead
from tandem.engine.in_flight import InFlight, resolve_async_scheduling
from tandem.engine.kv_blocks import BlockPool, KVStats
from tandem.engine.mask_pipeline import MaskPipeline
from tandem.engine.masks import StepMasks
from tandem.engine.output import RequestOutput, StreamDelta, TextAssembler, stream_delta
from tandem.engine.request import Request, grammar_spec, thinking_markers, thinking_tracker, validate
from tandem.engine.scheduler import Scheduler
from tandem.engine.stop import draft_budget, eos_ids, finish_reason, kept_tokens
from tandem.engine.workers import CacheLayout, Workers
from tandem.grammars.closing import Closer
from tandem.grammars.compiler import CompileJob, GrammarCompiler
from tandem.grammars.masks import MaskWalk, SpeculativeMasker
from tandem.grammars.tokenizer import GrammarTokenizer
from tandem.models.base import BlockTable, DraftInput, DraftProposal, ForwardBatch, RowSpans, TargetOutput

SMALL_STEP_TOKENS = 16  # a step of at most this many tokens runs on `EngineConfig.small_step_threads`


@dataclass
class EngineConfig:
    num_speculative_tokens: int = 4
    max_num_seqs: int = 8  # rows decoded together (the block table's rows)
    max_model_len: int = 1024  # tokens per row (prompt + generated)
    kv_cache_memory: int | None = None  # KV block bytes per rank, target and draft (None: max_num_seqs full rows)
    block_size: int = 16  # positions per KV block
    enable_prefix_caching: bool = True  # reuse the cached blocks of a prompt's longest registered prefix
    relaxed: RelaxedAcceptance | None = None  # relaxed acceptance inside <think>…</think>
    grammar_backend: str = "auto"  # xgrammar | llguidance | outlines | auto
    grammar_timeout_s: float = 30.0  # a grammar still compiling after this fails its request
    small_step_threads: int | None = 1  # CPU torch threads for steps of few tokens (None: torch's setting)
    adaptive: bool = True  # drafts per row chosen each step (engine/adaptive.py); False: always k
    forced_drafts: bool = True  # grammar-forced tokens drafted from the grammar (needs a draft; see _propose)
    max_forced_drafts: int = 8  # forced drafts a row may verify beyond its k model drafts
    closing_window: int = 64  # a grammar row this near max_tokens gets closing masks (0: never)
    graph_mode: str = "auto"  # eager | compiled | auto (engine/graphs.py)
    capture_sizes: tuple[int, ...] | None = None  # batch buckets graphs are built for (None: 1, 2, 4, .. max_num_seqs)
    capture_at_start: bool | None = None  # build every graph at start (None: on CUDA; CPU compiles build on first use)
    eos_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS: generation_config.json's (engine/stop.py)
    max_num_batched_tokens: int | None = 2048  # tokens one step feeds; longer prefills go in chunks (None: whole)
    async_scheduling: bool | None = None  # launch plain decode steps ahead of their reads (None: where it pays)
    lookahead: bool | None = None  # chained drafts propose before the verify is read (`Engine._lookahead`; None: CUDA)

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "max_num_seqs", "max_model_len", "block_size", "max_num_batched_tokens"):
            value, least = getattr(self, name), 0 if name == "num_speculative_tokens" else 1
            if value is not None and value < least:
                raise ValueError(f"EngineConfig.{name} = {value} must be at least {least}")


def check_speculation(has_draft: bool, num_speculative_tokens: int) -> None:
    """Refuse a draft with no tokens to propose (``ValueError``): its proposal would still write its cache."""
    if has_draft and num_speculative_tokens < 1:
        raise ValueError(
            f"num_speculative_tokens = {num_speculative_tokens} with a draft: a draft proposes at least 1 token a "
            f"step (no draft decodes plainly)"
        )


class Engine:
    """Continuous-batching speculative engine over one target and an optional draft.

    `draft=None` is the plain path: the same step with k = 0.
    """

    def __init__(self, target, draft, tokenizer, config: EngineConfig, workers: Workers | None = None) -> None:
        self.target, self.draft, self.tokenizer, self.config = target, draft, tokenizer, config
        self.workers = workers  # the other ranks of a parallel target (engine/workers.py), None on one device
        check_speculation(draft is not None, config.num_speculative_tokens)
        self.device = next(iter(target.parameters())).device if hasattr(target, "parameters") else torch.device("cpu")
        self.graph_mode = resolve_graph_mode(config.graph_mode, self.device)
        self.async_scheduling = resolve_async_scheduling(
            config.async_scheduling, self.device, self.graph_mode, draft=draft, parallel=workers is not None
        )
        self.k = config.num_speculative_tokens if draft is not None else 0
        self.forced_drafts = config.forced_drafts and draft is not None
        self.max_drafts = self.k + (config.max_forced_drafts if self.forced_drafts else 0)  # the widest verify - 1
        self.grammar_tokenizer = GrammarTokenizer(tokenizer, target.vocab_size)
        self.compiler = GrammarCompiler(timeout_s=config.grammar_timeout_s)
        self._eos = eos_ids(tokenizer, config.eos_token_ids)
        self._markers = thinking_markers(tokenizer)
        closer = (
            Closer.for_tokenizer(tokenizer, target.vocab_size, sorted(self._eos), window=config.closing_window)
            if config.closing_window > 0
            else None
        )  # answers that close within max_tokens (grammars/closing.py)
        self.masker = SpeculativeMasker(
            target.vocab_size, len(tokenizer), end_token_ids=sorted(self._eos), closer=closer
        )
        self.mask_pipeline = MaskPipeline(self.masker, config.max_num_seqs, self.max_drafts, self.device)
        self.step_masks = StepMasks(
            self.masker,
            self.mask_pipeline,
            k=self.max_drafts,
            detect_forced=self.forced_drafts,
            max_rows=config.max_num_seqs,
            relaxed=config.relaxed is not None,
            thinking_markers=self._markers is not None,
            device=self.device,
        )
        data_parallel_attention = workers is not None and workers.shard.data_parallel_attention
        capture_sizes = resolve_capture_sizes(config.capture_sizes, config.max_num_seqs)
        # Graph mode pads batches with rows that read and write a scratch slot past the rows' (engine/graphs.py).
        num_slots = config.max_num_seqs + (GraphRunner.SCRATCH_SLOTS if self.graph_mode == "compiled" else 0)
        # One-position caches of each model say what a position takes and whether the draft keeps a cache.
        probes = [target.new_cache(1, 1), None if draft is None else draft.new_cache(1, 1)]
        # Under data-parallel attention a rank holds the entries of its own slots only: each rank's pools hold its
        # domain's blocks (engine/kv_blocks.py), `num_blocks` of them.
        domains = workers.shard.size if data_parallel_attention else 1
        num_blocks = self._num_blocks(sum(c.bytes_per_position for c in probes if c is not None), domains)
        table = BlockTable(num_slots, config.max_model_len, config.block_size, num_blocks, self.device)
        self.target_cache = target.new_cache(num_slots, config.max_model_len, table=table)
        self.draft_cache = None if probes[1] is None else draft.new_cache(num_slots, config.max_model_len, table=table)
        self.blocks = BlockPool(table, enable_prefix_caching=config.enable_prefix_caching, domains=domains)
        # A model whose embedding rows are padded past the tokenizer: ids >= vocab_limit are never emitted
        # nor drafted (`_mask_padding`, `_draft_vocab_limit`), whatever else is in the batch.
        self.vocab_limit = min(len(tokenizer), target.vocab_size)
        # What the target's forward returns besides logits: the hidden states the draft reads.
        hidden_kind = None if draft is None else draft.hidden_kind
        self._hidden_outputs = {"return_hidden": hidden_kind == "last", "return_aux": hidden_kind == "aux"}
        self.runner = None
        widths = (1, self.k + 1, self.max_drafts + 1)  # decode; verify and a draft's first pass; forced runs
        if self.graph_mode == "compiled":
            self.runner = GraphRunner(
                target,
                self.target_cache,
                draft,
                self.draft_cache,
                widths=widths,
                capture_sizes=capture_sizes,
                max_chain=self.k,
                vocab_limit=self.vocab_limit,
            )
        self.lookahead = resolve_lookahead(config.lookahead, self.device, self.runner, parallel=workers is not None)
        self.lookahead_steps = 0  # steps whose proposal ran as a lookahead
        if self.runner is not None:
            at_start = self.device.type == "cuda" if config.capture_at_start is None else config.capture_at_start
            # Over several ranks graphs build on first use: the ranks build theirs as they follow the driver's steps.
            if at_start and workers is None:
                self.runner.capture(
                    **self._hidden_outputs, vocab_limit=self._draft_vocab_limit, lookahead=self.lookahead
                )
        if workers is not None:
            compiled = self.runner is not None
            layout = CacheLayout(
                num_slots,
                config.max_model_len,
                config.block_size,
                num_blocks,
                table.scratch_block,
                widths if compiled else None,
                tuple(capture_sizes) if compiled else None,
            )
            workers.mirror(self.target_cache, layout)
            if workers.has_draft:  # a draft in the target's layout (MTP): each rank keeps its rows' draft entries
                workers.mirror_draft()
        self.scheduler = Scheduler(
            config.max_num_seqs,
            self.masker,
            self.target_cache,
            self._markers,
            self.blocks,
            self._reserve,
            config.max_num_batched_tokens,
        )
        self._ids = itertools.count()
        # A step where no row drafts can skip the draft: a stateless one (no cache, no hidden states) needs nothing,
        # and one that reads the target's hidden states takes the step's tokens when a row next drafts
        # (`batching.defer_draft`), unless the ranks run it (a draft in the target's layout), each over its own
        # forward's hidden states.
        on_ranks = workers is not None and workers.has_draft
        stateless = draft is not None and draft.hidden_kind is None and self.draft_cache is None
        self._draft_skippable = stateless or (draft is not None and draft.hidden_kind is not None and not on_ranks)
        # A stateless draft that copies tokens (n-gram, suffix: each row's proposal reads only its own history)
        # proposes for the rows that draft alone; at a large batch most rows may draft nothing.
        self._proposes_by_row = stateless and not draft.follows_constraint
        # In graph mode a chained draft's whole proposal is one graph (`GraphRunner.draft_chain`; not when the ranks
        # run the draft): grammar rows propose through it too, and the walk follows their tokens after, as it
        # follows n-gram's; drafting under the grammar runs pass by pass, each pass a read of the device.
        on_driver = self.runner is not None and self.runner.draft_chain is not None and not on_ranks
        self._follows_grammar = draft is not None and draft.follows_constraint and not on_driver
        self.policy: AdaptivePolicy | None = None
        self.calibration_s = 0.0  # seconds the cost model's measurement took at start
        if draft is not None and config.adaptive and self.k > 0:
            start = time.perf_counter()
            cost = self._calibrate()
            self.calibration_s = time.perf_counter() - start
            self.policy = AdaptivePolicy(self.k, cost, draft_always=not self._draft_skippable)
        # The current (or last) step's start (`_mark`) and its seconds that entered the policy's models (verify and
        # proposal; None: not all timed); the next step's start gives the rest of its period (the policy's overhead).
        self._step_mark, self._step_timed = self._mark(), None
        self._in_flight: InFlight | None = None  # async scheduling's launched, unread step (in_flight.py)
        self.overlapped_steps = 0  # steps launched before the last one's tokens were read

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request. Nothing is queued when it raises: PromptTooLongError if the prompt cannot fit,
        ValueError for an empty prompt or a token id (prompt or logit bias) outside the vocabulary."""
        grammar_job = self.check_request(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(
            request_id=request_id,
            prompt=list(prompt),
            params=params,
            seed=params.seed if params.seed is not None else random.getrandbits(62),
            text=TextAssembler(
                self.tokenizer,
                eos_token_ids=(set() if params.ignore_eos else self._eos) | set(params.stop_token_ids or ()),
                tracker=thinking_tracker(self._markers, prompt),
                stop=params.stop_strings,
            ),
            grammar_job=grammar_job,
            tokens=list(prompt),
        )
        request.output = RequestOutput(
            request_id=request_id, prompt_token_ids=list(prompt), logprobs=None if params.logprobs is None else []
        )
        self.scheduler.add(request)
        return request_id

    def check_request(self, prompt: list[int], params: SamplingParams) -> CompileJob | None:
        """What `add_request` checks before it queues anything (it raises as that says), and the request's grammar
        compiling (None without one)."""
        validate(prompt, params, max_model_len=self.config.max_model_len, k=self.k, vocab_size=self.target.vocab_size)
        return self.compile_grammar(params)

    def compile_grammar(self, params: SamplingParams) -> CompileJob | None:
        """Start compiling the request's grammar (cached); raises InvalidGrammarSpec at once for a bad spec."""
        spec = grammar_spec(params)
        return None if spec is None else self.compiler.submit(spec, self.grammar_tokenizer, self.config.grammar_backend)

    def abort(self, request_id: str) -> None:
        """Drop a request, waiting or running; its slot is free for the next step."""
        self.scheduler.abort(request_id)
        if self.policy is not None:
            self.policy.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def waiting_ids(self) -> set[str]:
        """The ids of the requests not admitted yet (their grammar compiling, or no room)."""
        return {request.request_id for request in self.scheduler.waiting}

    def kv_stats(self) -> KVStats:
        """The KV block pool's counters: blocks total, in use and cached, prefix-cache lookups and hits, preemptions."""
        return self.blocks.stats(self.scheduler.preemptions)

    def pop_finished(self, request_id: str) -> RequestOutput | None:
        """The output of a finished request, handed over once (None while it runs)."""
        return self.scheduler.pop_finished(request_id)

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def step(self) -> list[StreamDelta]:
        """One unified step over all running rows; returns what each touched request gained."""
        if self.policy is not None and self._step_timed is not None:
            period = self._elapsed(self._step_mark)
            if period is not None:
                self.policy.observe_overhead(period - self._step_timed)
        self._step_mark, self._step_timed = self._mark(), None
        if self._in_flight is not None and not self._continues(self._in_flight):
            in_flight, self._in_flight = self._in_flight, None
            return self._commit_in_flight(in_flight, continuing=False)
        rows = self.scheduler.schedule()
        if not rows:
            if self.scheduler.waiting:  # only grammars still compiling: yield the CPU to their workers
                time.sleep(0.001)
            return []
        k = self._step_k(rows)
        ends = [self.scheduler.chunk_ends.get(r.request_id) for r in rows]
        if self._overlaps(rows, k, ends):
            return self._overlapped_step(rows)
        inputs = self._verify_inputs(rows, k, ends)
        with torch_threads(self._threads_for(inputs.batch)):
            return self._run_step(rows, inputs, k, [b for b, end in enumerate(ends) if end is not None])

    def _verify_inputs(
        self, rows: list[Request], k: int, ends: list[int | None] | None = None, *, adjust: bool = True
    ) -> VerifyInputs:
        """`batching.verify_inputs` of the step's rows from what their target caches hold, planned for the graph
        runner in graph mode, else for the eager layout."""
        held = [self.target_cache.lengths[r.slot] for r in rows]
        return verify_inputs(
            rows,
            k,
            self.k,
            held,
            self.device,
            ends,
            vocab_size=self.target.vocab_size,
            runner=self.runner,
            cache=self.target_cache,
            adjust=adjust,
            lookahead=self._lookahead_rows(rows, k, held, ends),
        )

    def _lookahead_rows(
        self, rows: list[Request], k: int, held: list[int], ends: list[int | None] | None
    ) -> RowSpans | None:
        """The draft's rows for a lookahead proposal after this step's verify (`_lookahead`), None when it proposes
        after the commit: each row decodes (no prompt or chunk to prefill, nothing the draft has not taken), no row
        adjusts its logits (the chain graph proposes without penalties), and the first pass and the chain fit a
        graph and the rows' blocks."""
        if not self.lookahead or k == 0 or (ends is not None and any(end is not None for end in ends)):
            return None
        for r, start in zip(rows, held):
            if start != len(r.tokens) - 1 or r.undrafted is not None or r.params.adjusts_logits:
                return None
        spans = RowSpans([start + 1 for start in held], [len(r.drafts) + 1 for r in rows], [r.slot for r in rows])
        table = self.target_cache.table
        for end, slot in zip(spans.ends(), spans.slots):  # the chain writes up to k - 1 positions past the first pass
            if end + self.k - 1 > min(table.max_len, table.capacity(slot)):
                return None
        return spans if self.runner.fits(spans) else None

    def _adaptive(self) -> bool:
        return self.policy is not None and self.config.adaptive

    def _mark(self) -> tuple[float, float]:
        """The start of a timing for the adaptive policy: the clock, and the graph runner's build time so far."""
        return time.perf_counter(), 0.0 if self.runner is None else self.runner.compile_s

    def _elapsed(self, mark: tuple[float, float]) -> float | None:
        """Seconds since `mark`, or None when a graph was built meanwhile: a capture is no step's time."""
        started, built = mark
        return None if self._mark()[1] != built else time.perf_counter() - started

    def _step_k(self, rows: list[Request]) -> int:
        """The step's draft positions per row: the most any row keeps, at least k without adaptive speculation
        (with it, 0 is the plain step)."""
        longest = max((len(r.drafts) for r in rows), default=0)
        return longest if self._adaptive() else max(longest, self.k)

    def _num_blocks(self, position_bytes: int, domains: int) -> int:
        """A rank's pool's blocks (the scratch block included): what `kv_cache_memory` holds at `position_bytes` a
        position (target and draft entries), at least one full row; None: full rows for its slots, one of `domains`
        (each rank holds its domain's rows)."""
        config = self.config
        per_row = -(-config.max_model_len // config.block_size)
        if config.kv_cache_memory is None:
            return -(-config.max_num_seqs // domains) * per_row + 1
        block_bytes = config.block_size * position_bytes
        num_blocks = config.kv_cache_memory // block_bytes
        if num_blocks < per_row:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory} holds {num_blocks} blocks of {block_bytes} bytes; one row "
                f"of max_model_len={config.max_model_len} needs {per_row} ({per_row * block_bytes} bytes)"
            )
        return num_blocks + 1

    def _reserve(self, r: Request) -> int:
        """The positions `r`'s next step writes: its verify's (tokens and drafts) and, for a draft with a cache,
        the next proposal's (up to k past the tokens the verify commits)."""
        ahead = self.k if self.draft_cache is not None else 0
        return min(len(r.tokens) + len(r.drafts) + ahead, self.config.max_model_len)

    @property
    def _draft_vocab_limit(self) -> int | None:
        """`DraftInput.vocab_limit`: where a draft that chooses its tokens must stop (None: every id is real)."""
        padded = self.draft is not None and self.draft.follows_constraint and self.vocab_limit < self.target.vocab_size
        return self.vocab_limit if padded else None

    def _draft_hidden(self, out: TargetOutput) -> torch.Tensor | None:
        """The hidden states the draft reads of a target forward's output (`_hidden_outputs` asked for them)."""
        return out.hidden if self._hidden_outputs["return_hidden"] else out.aux_hidden

    def _mask_padding(self, logits: torch.Tensor, *_) -> torch.Tensor:
        """`logits [..., V]` with the ids past the tokenizer at -inf, in place (nothing when V fits it)."""
        return forbid_ids_from(logits, self.vocab_limit)

    def _calibrate(self) -> CostModel:
        """The time of a verify step (target forward + acceptance) over T tokens, measured on dummy rows
        in the free KV slots: decode-shaped (1 token per row) and verify-shaped (k + 1 per row), for one
        row and for as many rows as a small step holds (at most `max_num_seqs`; `CostModel` extrapolates
        past them), each the fastest of two runs after a warm-up. Runs once, before any request holds
        a slot. In graph mode the forwards go through the runner and return what a step's do: the cost model
        reads the graphs' times (where the runner did not capture at start, the warm-up builds these shapes')."""
        prefix, k = 8, self.k
        if prefix + k + 1 > self.config.max_model_len:
            prefix = 1
        per_row = self.blocks.blocks_for(prefix + k + 1)
        rows = max(1, min(self.config.max_num_seqs, SMALL_STEP_TOKENS // (k + 1), self.blocks.fits(per_row)))
        for slot in range(rows):
            self.blocks.grow(slot, prefix + k + 1)
        token = self.tokenizer.eos_token_id or 0
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        def forward(num_rows: int, per_row: int, start: int) -> torch.Tensor:
            spans = RowSpans([start] * num_rows, [per_row] * num_rows, list(range(num_rows)))
            n = num_rows * per_row
            batch = ForwardBatch.build(
                int64_tensor([token] * n, self.device), spans, logits_indices=int64_tensor(list(range(n)), self.device)
            )
            with torch_threads(self._threads_for(batch)):
                logits = self._forward(batch, **self._hidden_outputs).logits.view(num_rows, per_row, -1)
                if per_row == 1:
                    sample(logits[:, 0])
                else:
                    drafts = torch.full((num_rows, per_row - 1), token, dtype=torch.int64, device=self.device)
                    accept(logits, drafts)
            return logits

        with torch.inference_mode():
            forward(rows, prefix, 0)
            points: dict[int, float] = {}
            for num_rows in sorted({1, rows}):
                for per_row in (1, k + 1):
                    times = []
                    for _ in range(3):
                        sync()
                        start = time.perf_counter()
                        forward(num_rows, per_row, prefix)
                        sync()
                        times.append(time.perf_counter() - start)
                        self.target_cache.truncate(list(range(num_rows)), [prefix] * num_rows)
                    total = num_rows * per_row
                    points[total] = min(points.get(total, float("inf")), *times[1:])
            self.target_cache.truncate(list(range(rows)), [0] * rows)
            for slot in range(rows):
                self.blocks.release(slot)
        tokens = sorted(points)
        return CostModel(tokens, [points[t] for t in tokens])

    def _forward(self, batch: ForwardBatch, *, return_hidden: bool = False, return_aux: bool = False):
        """The target's forward of `batch` into its cache: through the graph runner in graph mode."""
        model = self.target if self.runner is None else self.runner
        if self.workers is None:
            return model.forward(batch, self.target_cache, return_hidden=return_hidden, return_aux=return_aux)
        self.workers.forward(batch, return_hidden=return_hidden, return_aux=return_aux)
        return self.workers.guard(
            model.forward, batch, self.target_cache, return_hidden=return_hidden, return_aux=return_aux
        )

    def _threads_for(self, batch: ForwardBatch) -> int | None:
        """The torch threads a step over `batch` runs with (None: torch's setting)."""
        if self.device.type == "cpu" and batch.num_tokens <= SMALL_STEP_TOKENS:
            return self.config.small_step_threads
        return None

    def _run_step(self, rows: list[Request], inputs: VerifyInputs, k: int, chunked: list[int]) -> list[StreamDelta]:
        """Steps 2-6 of the module docstring over `rows`, merged into `batch` with k positions per row. The rows
        at `chunked` prefill a chunk of their tokens: the forward writes their caches, and nothing else happens
        to them but the draft's pass over the chunk (`_fill_draft`)."""
        batch = inputs.batch
        # A prefill's time says nothing of a verify's.
        prefill = any(start < len(r.tokens) - 1 for r, start in zip(rows, batch.spans.starts))
        verified = [b for b in range(len(rows)) if b not in chunked]
        full = [rows[b] for b in verified]
        deltas, pending_masks = [], None
        if full:
            # [B, >= k] host: the masks cover k whatever this step verifies
            pending_masks = self.step_masks.submit(full, inputs.host_drafts)
        out = self._forward(batch, **self._hidden_outputs)
        if full:
            logits = out.logits.view(len(rows), k + 1, -1)
            greedy = None if out.greedy is None or inputs.adjustments is not None else out.greedy.view(len(rows), k + 1)
            if chunked:
                logits = logits[inputs.verified]
                greedy = None if greedy is None else greedy[inputs.verified]
            logits = self._mask_padding(logits)
            drafts = inputs.drafts
            scores = logits if inputs.adjustments is None else inputs.adjustments.apply(logits, drafts)
            bitmask, in_thinking = self.step_masks.wait(pending_masks)
            if k < self.k:  # masks are built for k drafts; this step verifies fewer
                bitmask = None if bitmask is None else bitmask[:, : k + 1]
                in_thinking = None if in_thinking is None else in_thinking[:, : k + 1]
            ahead = None if inputs.lookahead is None else functools.partial(self._lookahead, inputs.lookahead, out)
            result = self._accept(full, scores, drafts, bitmask, in_thinking, inputs.sampling, greedy, ahead)

            def logprobs_of(b: int, emitted: list[int]) -> list[TokenLogprob]:  # from the positions that emitted them
                return token_logprobs(logits[b, : len(emitted)], emitted, full[b].params.logprobs)

            deltas = self._commit(full, result.to_host(), logprobs_of)
        seconds = None if prefill else self._elapsed(self._step_mark)
        if self.policy is not None and seconds is not None:
            self.policy.cost.observe(batch.num_tokens, seconds)
        self._step_timed = seconds  # `_draft_proposal` adds the proposal's
        if self.draft is not None:
            live = [b for b, r in enumerate(full) if r.output.finish_reason is None]
            proposed = None if not full or result.carried is None else [result.carried[b] for b in live]
            self._propose([full[b] for b in live], rows, out, batch, proposed)
        if chunked and self.draft_cache is not None:
            self._fill_draft([rows[b] for b in chunked], rows, out, batch)
        self._register_blocks(rows)
        if not self.scheduler.running:  # the engine may idle before its next step: that wait is no step's
            self._step_timed = None
        return deltas

    def _register_blocks(self, rows: list[Request]) -> None:
        """After a step: each live row (finished rows gave their blocks back) registers its full committed blocks
        and gives back those past its tokens. A block holds the target's and the draft's entries: registered up to
        a chunk's end, else len(r.tokens) - 1 (an in-flight step's placeholder is the last token), and no further
        than the draft has taken; a chunked row keeps the blocks of the prompt to come."""
        for r in rows:
            if r.slot >= 0:
                held = self.target_cache.lengths[r.slot]
                if r.undrafted is not None:
                    held = min(held, r.undrafted.start)
                self.blocks.register(r.slot, r.tokens, held)
                self.blocks.trim(r.slot, len(r.tokens))

    # ---------------------------------------------------------------- async scheduling (in_flight.py)
    def _overlaps(self, rows: list[Request], k: int, ends: list[int | None]) -> bool:
        """Whether this step launches without reading back: async scheduling's plain decode step, every row
        decoding one token (a grammar's mask and a row's penalties follow the commit: `_overlapped_step`)."""
        if not self.async_scheduling or k > 0 or any(end is not None for end in ends):
            return False
        if self._in_flight is not None:  # `_continues` held: the same rows, nothing admitted or preempted
            assert rows == self._in_flight.rows, "async scheduling: the rows changed under an in-flight step"
            return True
        return all(self.target_cache.lengths[r.slot] == len(r.tokens) - 1 for r in rows)

    def _continues(self, in_flight: InFlight) -> bool:
        """Whether the next step may launch before ``in_flight``'s tokens are read: the same rows run (none
        finished or aborted, none to be admitted: requests may wait while every slot is taken), none reaches
        max_tokens or the context with the in-flight token (it finishes then), and every row's next block fits
        without a preemption."""
        rows = in_flight.rows
        if self.scheduler.may_admit() or self.scheduler.running != rows:
            return False
        if any(r.num_generated >= r.params.max_tokens or len(r.tokens) >= self.config.max_model_len for r in rows):
            return False
        return self.blocks.can_grow({r.slot: self._reserve(r) for r in rows})

    def _overlapped_step(self, rows: list[Request]) -> list[StreamDelta]:
        """Launch a plain decode step's forward over `rows` (fed the in-flight step's tokens on the device, if one
        runs), read and commit the in-flight step while the device runs it, then sample: a grammar row's mask and a
        row's penalties follow the tokens just committed. Returns the in-flight step's deltas."""
        previous = self._in_flight
        inputs = self._verify_inputs(rows, 0, adjust=False)
        threads = self._threads_for(inputs.batch)
        if previous is not None:
            # Each row feeds its in-flight token, a placeholder on the host (-1 where its mask allowed nothing: that
            # row finishes at the commit below, and its sample here is dropped).
            inputs.batch.input_ids.copy_(previous.tokens.clamp(min=0))
        with torch_threads(threads):
            out = self._forward(inputs.batch)
            logits = self._mask_padding(out.logits.view(len(rows), 1, -1))
        deltas = [] if previous is None else self._commit_in_flight(previous, continuing=True)
        bitmask = self._next_masks(rows)
        adjustments = sampling.adjustments(rows, self.target.vocab_size, self.device)
        greedy = None if out.greedy is None or adjustments is not None else out.greedy.view(len(rows), 1)
        with torch_threads(threads):
            scores = logits if adjustments is None else adjustments.apply(logits, inputs.drafts)
            result = self._accept(rows, scores, inputs.drafts, bitmask, None, inputs.sampling, greedy)
            tokens = result.tokens[:, 0]
            num_top = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
            logprobs = () if num_top is None else logprob_tensors(logits[:, 0], tokens, num_top)
        self._in_flight = InFlight.launch(rows, tokens, logprobs)
        self.overlapped_steps += 1
        for r in rows:
            if r.slot >= 0:
                r.tokens.append(PLACEHOLDER_TOKEN_ID)
        self._register_blocks(rows)
        if all(r.slot < 0 for r in rows):  # every row finished: the step just launched is read by no one
            self._in_flight = None
        return deltas

    def _next_masks(self, rows: list[Request]) -> torch.Tensor | None:
        """An overlapped step's grammar masks ``[B, 1, W]`` on the device, built for the live rows once the in-flight
        step committed (a row that finished there allows every token: its sample is dropped); None when no live row
        has a grammar."""
        live = [b for b, r in enumerate(rows) if r.slot >= 0]
        live_rows = [rows[b] for b in live]
        if not self.step_masks.has_grammar(live_rows):
            return None
        no_drafts = torch.empty(len(live_rows), 0, dtype=torch.int64)
        bitmask, _ = self.step_masks.wait(self.step_masks.submit(live_rows, no_drafts))
        if len(live) == len(rows):
            return bitmask
        every = bitmask.new_full((len(rows), *bitmask.shape[1:]), -1)
        every[int64_tensor(live, self.device)] = bitmask
        return every

    def _commit_in_flight(self, in_flight: InFlight, *, continuing: bool) -> list[StreamDelta]:
        """Read ``in_flight``'s tokens and commit them to its rows still running (finished and aborted rows
        gave their slots back). ``continuing``: the next step already runs, its entries in the caches."""
        tokens = in_flight.read()
        live = [b for b, r in enumerate(in_flight.rows) if r.slot >= 0]
        rows = [in_flight.rows[b] for b in live]
        for r in rows:
            r.tokens.pop()  # the placeholder
        # A row whose mask allowed nothing sampled PLACEHOLDER_TOKEN_ID: a dead end, as `AcceptanceResult.to_host`.
        results = [([], 0, True) if tokens[b] == PLACEHOLDER_TOKEN_ID else ([tokens[b]], 0, False) for b in live]

        def logprobs_of(i: int, emitted: list[int]) -> list[TokenLogprob]:
            return in_flight.token_logprobs(live[i], emitted, rows[i].params.logprobs)

        deltas = self._commit(rows, results, logprobs_of, truncate=not continuing)
        if not continuing:
            self._register_blocks(rows)
        return deltas

    def _fill_draft(self, chunked: list[Request], rows: list[Request], out, batch: ForwardBatch) -> None:
        """The draft's cache over the `chunked` rows' chunks: each chunk token's successor paired with the target's
        hidden state at it, as a proposal's first pass writes them (eagerly, its one token unread), so the draft
        cache is whole when the last chunk's step proposes."""
        hidden_all = self._draft_hidden(out)
        draft_ids, hidden, histories, _ = draft_batch(
            chunked, rows, batch, hidden_all, self.device, cache=self.draft_cache, num_steps=1
        )
        self.draft_cache.truncate(draft_ids.spans.slots, draft_ids.spans.starts)
        self._run_draft(DraftInput(draft_ids, hidden, histories), 1)

    def _accept(
        self,
        rows: list[Request],
        scores: torch.Tensor,
        drafts: torch.Tensor,
        bitmask: torch.Tensor | None,
        in_thinking: torch.Tensor | None,
        settings: SamplingTensors | None,
        greedy: torch.Tensor | None = None,
        ahead: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> AcceptanceResult:
        """Step 4 over the adjusted logits `scores` [B, k+1, V], the drafts [B, k] and the rows' sampling `settings`
        (staged with the verify batch: `VerifyInputs.sampling`) on the device. `greedy` [B, k+1]: the argmaxes of
        unadjusted logits where the forward chose them (`TargetOutput.greedy`), which decide a greedy step without
        masks or relaxed positions: no kernel of its own then. `ahead(emitted [B, k+1], accepted [B])` (k > 0):
        launches a proposal from the decided tokens on the device (`_lookahead`), read with the result
        (`AcceptanceResult.carried`)."""
        k = scores.shape[1] - 1
        relaxed = self.config.relaxed is not None and in_thinking is not None
        if greedy is not None and settings is None and bitmask is None and not relaxed:
            if k == 0:
                return AcceptanceResult.without_drafts(greedy[:, 0])
            carry = None if ahead is None else ahead(greedy, accepted_counts(greedy, drafts))
            return accept_argmax(greedy, drafts, carry)
        if k == 0:  # the plain path: `sample` is `accept` without drafts, minus the verification work
            return AcceptanceResult.without_drafts(
                sample(scores[:, 0], settings, None if bitmask is None else bitmask[:, 0])
            )
        result = accept(
            scores,
            drafts,
            draft_probs=sampling.draft_probs(rows, k, scores.shape[-1], self.device),
            sampling=settings,
            bitmask=bitmask,
            in_thinking=in_thinking,
            relaxed=self.config.relaxed,
        )
        return result if ahead is None else result.read_with(ahead(result.tokens.clamp(min=0), result.num_accepted))

    def _lookahead(self, lookahead: Lookahead, out: TargetOutput, emitted: torch.Tensor, accepted: torch.Tensor):
        """Launch the draft's proposal of k tokens per row right after the acceptance, before the host reads it (a
        graph-mode step is bound by the host: the draft's batch was staged with the verify's, and no host work stands
        between the verify and the proposal). Its first pass runs over each row's verified positions, fed the tokens
        emitted there (`emitted [B, k+1]`; those past the row's accepted drafts and the token after them are never
        committed) and the verify's hidden states; the chain goes on from each row's output at its `accepted [B]`
        drafts, all on the device. Returns the proposal ``[B, k]``; the rows that go on draft its chosen prefix
        (`_propose`). The first pass writes the draft's entries of the committed tokens as a proposal after the
        commit does, and entries past them that the next proposal rewrites."""
        batch = lookahead.over(emitted)
        self.draft_cache.truncate(batch.spans.slots, batch.spans.starts)
        chain = functools.partial(self.runner.draft_chain, start=accepted)
        inp = DraftInput(batch, self._draft_hidden(out), None, vocab_limit=self._draft_vocab_limit, chain=chain)
        self.lookahead_steps += 1
        return self._run_draft(inp, self.k).tokens

    def _commit(
        self,
        rows: list[Request],
        results: list[tuple[list[int], int, bool]],
        logprobs_of: Callable[[int, list[int]], list[TokenLogprob]],
        *,
        truncate: bool = True,
    ) -> list[StreamDelta]:
        """Step 5: append each row's emitted tokens (`AcceptanceResult.to_host`'s rows; ``logprobs_of(b, emitted)``:
        row b's emitted tokens' logprobs, asked only of rows that want them). ``truncate=False`` keeps the target
        cache's entries past the committed tokens: an in-flight step's."""
        deltas = []
        for b, (r, (emitted_all, num_accepted, dead_end)) in enumerate(zip(rows, results)):
            emitted = kept_tokens(r, emitted_all)
            self.masker.commit(r.request_id, emitted)
            r.tokens.extend(emitted)
            stats = r.output.stats
            stats.steps += 1
            stats.drafted += len(r.drafts)
            stats.accepted += min(num_accepted, len(emitted))
            if self.policy is not None:  # the chosen drafts: a forced run after them is accepted surely once reached
                chosen = len(r.drafts) - r.forced_run
                self.policy.observe(r.request_id, chosen, min(num_accepted, chosen), r.asked_drafts)
            r.clear_drafts()
            if truncate:
                self.target_cache.truncate([r.slot], [len(r.tokens) - 1])
            reason = finish_reason(
                r,
                grammar_terminated=self.masker.is_terminated(r.request_id),
                dead_end=dead_end and len(emitted) == len(emitted_all),
                k=self.k,
                max_model_len=self.config.max_model_len,
            )
            logprobs = None if r.params.logprobs is None else logprobs_of(b, emitted)
            deltas.append(stream_delta(r.output, r.text, emitted, logprobs, reason))
            if reason is not None:
                if self.draft is not None:
                    self.draft.release(r.slot, r.tokens)
                self.scheduler.finish(r, reason)
                if self.policy is not None:
                    self.policy.forget(r.request_id)
        return deltas

    def _propose(
        self, live: list[Request], rows: list[Request], out, batch: ForwardBatch, ahead: list[list[int]] | None = None
    ) -> None:
        """Step 6: give each live row's newly committed tokens and their hidden states to the draft; a row's
        drafts are then its chosen prefix of the proposal and, where its grammar forces them, the forced
        tokens that follow (`_choose_drafts`). `ahead`: the live rows' proposals, which the draft made ahead of
        the commit (`_lookahead`), all its tokens taken."""
        if not live:
            return
        keep = None
        if self._adaptive():
            keep = self.policy.choose([r.request_id for r in live], [r.params.temperature > 0 for r in live])
        run_draft = ahead is None and not (keep is not None and not any(keep) and self._draft_skippable)
        drafted = run_draft or ahead is not None
        forcing = self.forced_drafts and self.step_masks.has_grammar(live)
        if not drafted:  # the draft skips this step
            if self.draft.hidden_kind is not None:
                defer_draft(live, rows, batch, self._draft_hidden(out))
            if not forcing:
                return  # no row drafts: the next step is the plain step
        budgets = [draft_budget(r, self.max_drafts, self.config.max_model_len) for r in live]
        limits = [min(budget, self.k if keep is None else keep[b]) for b, budget in enumerate(budgets)]
        follows = self._follows_grammar
        walk = self.step_masks.walk(live) if follows or forcing else None
        proposed, probs = ([[] for _ in live] if ahead is None else ahead), None
        # The draft proposes as far as the row that drafts most (its first pass always, if the ranks run it).
        passes = self.k if keep is None or ahead is not None else draft_passes(max(keep), self.policy.draft_always)
        try:
            if run_draft and self._proposes_by_row:
                drafting = [b for b, limit in enumerate(limits) if limit > 0]
                if drafting:
                    by_row, probs = self._draft_proposal([live[b] for b in drafting], rows, out, batch, None, passes)
                    for b, tokens in zip(drafting, by_row):
                        proposed[b] = tokens
                    if probs is not None:  # [drafting rows, passes, V] -> [live rows, ...]; the others never read
                        rows_index = torch.tensor(drafting, device=probs.device)
                        probs = probs.new_zeros(len(live), *probs.shape[1:]).index_copy_(0, rows_index, probs)
            elif run_draft:
                # Drafts no host work reads (no walk; no thinking phases to find in them) stay on the device.
                read = walk is not None or self.step_masks.reads_drafts
                proposed, probs = self._draft_proposal(
                    live, rows, out, batch, walk if follows else None, passes, read=read
                )
            if forcing and follows and run_draft:  # the draft walked its tokens: go on with forced ones
                walk.extend_forced([min(m, n) for m, n in zip(limits, walk.lengths)], budgets)
            elif forcing:
                walk.advance_proposals(proposed, limits, budgets)
        finally:
            if walk is not None:
                walk.finish()
        self._choose_drafts(live, proposed, probs, limits, budgets, walk, forcing, passes if drafted else 0)

    def _draft_proposal(
        self,
        live: list[Request],
        rows: list[Request],
        out,
        batch: ForwardBatch,
        walk: MaskWalk | None,
        passes: int,
        *,
        read: bool = True,
    ) -> tuple[list[list[int]] | torch.Tensor, torch.Tensor | None]:
        """The draft's proposal of `passes` tokens for the live rows under `walk` (None: free): tokens [B][passes]
        read to the host (or, without `read`, a deterministic draft's [B, passes] left on the device) and probs
        [B, passes, V] (None: deterministic)."""
        mark = self._mark()
        catching_up = any(r.undrafted is not None for r in live)  # read before `draft_batch` takes those tokens
        hidden_all = self._draft_hidden(out)
        follows = self.draft.follows_constraint
        draft_ids, hidden, histories, adjustments = draft_batch(
            live,
            rows,
            batch,
            hidden_all,
            self.device,
            runner=self.runner,
            cache=self.draft_cache,
            num_steps=passes,
            vocab_size=self.target.vocab_size if follows else None,
        )
        if self.draft_cache is not None:
            self.draft_cache.truncate(draft_ids.spans.slots, draft_ids.spans.starts)
        # A first pass over more than a step's commits (a deferred step's tokens too, or a prompt's after its
        # prefill) takes no proposal's usual time.
        usual = not catching_up and draft_ids.num_tokens <= len(live) * (self.max_drafts + 1)
        adjust = None if adjustments is None else adjustments.apply_after
        proposal = self._run_draft(
            DraftInput(
                draft_ids,
                hidden,
                histories,
                constraint=walk,
                adjust=adjust,
                vocab_limit=self._draft_vocab_limit,
                step=None if self.runner is None else self.runner.draft_step,
                chain=None if self.runner is None else self.runner.draft_chain,
            ),
            passes,
        )
        on_device = not read and proposal.probs is None
        proposed = proposal.tokens if on_device else proposal.tokens.tolist()  # one read of the device for every row
        seconds = self._elapsed(mark) if usual else None
        # With lookahead proposals a verify's timing holds its proposal's: the policy's draft(J) stays 0 (adaptive.py).
        if self._adaptive() and seconds is not None and not self.lookahead:
            self.policy.observe_draft_time(seconds, passes)
        self._step_timed = None if seconds is None or self._step_timed is None else self._step_timed + seconds
        return proposed, proposal.probs

    def _run_draft(self, inp: DraftInput, num_tokens: int) -> DraftProposal:
        """The draft's proposal of `num_tokens` per row into its cache: on every rank when the workers hold their
        parts of it (a draft in the target's layout, engine/workers.py), else here."""
        if self.workers is not None and self.workers.has_draft:
            return self.workers.propose(self.draft, inp, self.draft_cache, num_tokens)
        return self.draft.propose(inp, self.draft_cache, num_tokens)

    def _choose_drafts(
        self,
        live: list[Request],
        proposed: list[list[int]] | torch.Tensor,
        probs: torch.Tensor | None,
        limits: list[int],
        budgets: list[int],
        walk: MaskWalk | None,
        forcing: bool,
        passes: int,
    ) -> None:
        """Each live row's drafts: its proposal up to `limits[b]`, or, with forced drafting (`forcing`: the walk
        went on with forced tokens), that prefix of the walk's path and the run of forced tokens after it, up to
        `budgets[b]`, where adaptive speculation finds that the run pays (always otherwise). `passes`: the draft's
        passes this step (0: it did not run)."""
        prefixes, runs = [], []
        on_device = isinstance(proposed, torch.Tensor)  # [B, passes]: every row's whole proposal
        for b in range(len(live)):
            if on_device:
                prefixes.append(min(limits[b], proposed.shape[1]))
                runs.append(0)
            elif forcing:
                prefixes.append(min(limits[b], walk.lengths[b]))
                runs.append(min(walk.forced_run(b, prefixes[b]), min(walk.lengths[b], budgets[b]) - prefixes[b]))
            else:
                prefix = proposed[b][: limits[b]]
                if PLACEHOLDER_TOKEN_ID in prefix:  # a draft with fewer proposals (n-gram miss)
                    prefix = prefix[: prefix.index(PLACEHOLDER_TOKEN_ID)]
                prefixes.append(len(prefix))
                runs.append(0)

        def certain(b: int, n: int) -> list[bool]:  # which of row b's first n drafts are forced
            return [forcing and walk.forced[b][i] >= 0 for i in range(n)]

        verify_runs = [run > 0 for run in runs]
        if self._adaptive() and any(verify_runs):
            verify_runs = self.policy.forced_runs(
                [r.request_id for r in live],
                [certain(b, n) for b, n in enumerate(prefixes)],
                runs,
                [r.params.temperature > 0 for r in live],
                self.policy.draft_seconds(passes),
            )
        for b, r in enumerate(live):
            r.asked_drafts = limits[b]
            r.forced_run = runs[b] if verify_runs[b] else 0
            n = prefixes[b] + r.forced_run
            if on_device:
                r.drafts, r.drafts_on_device = [PLACEHOLDER_TOKEN_ID] * n, (proposed, b) if n else None
            else:
                r.drafts = walk.path(b)[:n] if forcing else proposed[b][:n]
            r.draft_forced = certain(b, n)
            r.draft_probs = forced_draft_probs(None if probs is None else probs[b], r.drafts, r.draft_forced)
            r.walked_masks = self.step_masks.walked(walk, b, n)


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
