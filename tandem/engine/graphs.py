"""Graph mode: the target's decode/verify forwards and the chained drafts' steps as graphs over fixed shapes.

A step of ``B`` rows with at most ``Q`` tokens each is padded to a bucket: ``B`` up to the next
capture size (``EngineConfig.capture_sizes``, default 1, 2, 4, ... ``max_num_seqs``), ``Q`` up to the
next static width (1, or ``k + 1`` for a verify and a draft's first pass over newly committed
tokens). Each ``(bucket, width)`` gets one graph, built at start (:meth:`GraphRunner.capture`) or on first use,
that reads persistent buffers (token ids, positions, write indices, row slots, the draft's hidden inputs, and the
caches' block table) which every step fills, so a graph reads the same addresses at every replay. What fills them is
planned on the host ahead and travels in the step's staged copies (``stage_forward`` with the verify
batch, ``stage_draft`` with the draft's batch for all of a proposal's steps; `core.transfer.Staging`),
so a replay copies on the device, not from the host. The body is the providers' tensor half
(``Target.forward_layout``, a chained draft's ``step_layout``) over
:meth:`~tandem.models.attention.RaggedLayout.static`: writes scattered through the block table, each
row's blocks gathered and its keys masked by position. Padding rows read a scratch slot past the
engine's (``GraphRunner.SCRATCH_SLOTS``), whose table holds only the scratch block, and padding
tokens write the scratch block, so they never touch a real row's cache.

A chained draft's greedy proposal for rows without constraint or adjustments is one graph of all its steps
(``draft_chain``, keyed by bucket, width and length): each step's head and argmax feed the next inside it, so the
host launches one replay per proposal instead of a replay per step and the head and argmax between them. The
steps after the first plan themselves inside the graph: one token per row at the position after the last, written
where the block table puts it. The chain starts from each row's last token's output, or, for a lookahead proposal
(``draft_chain(..., start=...)``, `Engine._lookahead`), from the output at a per-row index the device computed:
the draft's first pass then runs over every verified position's emitted token before the host knows how many
were accepted, and the chain goes on from the last accepted one. The target's graph returns its greedy tokens
besides its logits (the argmax below ``vocab_limit``, `TargetOutput.greedy`), so a step of free greedy rows
launches no sampling kernel after the replay.

Over several ranks each rank runs its own runner, over the shapes the driver's runs (every rank sees the same
spans, so they build and replay the same graphs at the same steps and meet in the collectives inside them).
Under data-parallel attention (DeepSeek-V3) a rank caches only its own rows' entries, and which rows those are
changes every step: its plan makes the other rows padding rows (scratch slot, scratch writes) and the body
passes the provider ``owned`` (read from the slots buffer), with which it zeroes their attention outputs before
the all-reduce that gives every rank every row's.

- CUDA: one ``torch.cuda.CUDAGraph`` per shape, captured after an eager warm-up and one on a side stream, every
  graph in one memory pool; the key window is a row's whole block table (a graph's shapes are fixed), so attention
  may take cuDNN's kernel, planned in the warm-up (``models.attention.graph_attention``). A graph captures eager
  kernels, or with ``$TANDEM_CUDA_COMPILE_BACKEND`` (``inductor``) the body compiled by ``torch.compile`` with
  that backend (``fullgraph=True``, shapes static), which fuses the elementwise kernels between the matmuls: fewer
  and shorter kernels for the device, at a compile per shape at start (kept in the persistent cache below).
- CPU: ``torch.compile(fullgraph=True)`` per shape and torch thread count (backend ``inductor``, or
  ``$TANDEM_COMPILE_BACKEND``: tests use ``aot_eager`` or ``eager``), its generated code kept in a persistent
  cache (``$TORCHINDUCTOR_CACHE_DIR``, default ``~/.cache/tandem/inductor``) so a restart does not
  compile from scratch. The key window is each step's (the blocks up to its rows' furthest position),
  one dynamic size in the graph: attending over a whole 4096-position row costs a small model more
  than its weights on the CPU.

Prefill stays eager: a prompt's length is unbounded, so one graph per length (or per padded length
bucket, each a full compile) would cost more than the host overhead it removes from a forward that
is long anyway. A step that fits no bucket (a prefill, more rows than the largest capture size)
runs eagerly and counts in :attr:`GraphRunner.fallbacks`.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from tandem.core.transfer import Staging
from tandem.decoding.sampling import forbid_ids_from
from tandem.models.attention import RaggedLayout, graph_attention
from tandem.models.base import ForwardBatch, KVCache, RowSpans, TargetOutput

GRAPH_MODES = ("auto", "eager", "compiled")
AUTO_GRAPH_MODE = {"cuda": "compiled", "cpu": "eager"}  # "auto" per device type (README, graph mode)
BACKEND_ENV = "TANDEM_COMPILE_BACKEND"  # the CPU's torch.compile backend (default inductor)
CUDA_BACKEND_ENV = "TANDEM_CUDA_COMPILE_BACKEND"  # a torch.compile backend inside CUDA graphs (default: none)
CACHE_DIR = Path.home() / ".cache" / "tandem" / "inductor"  # TORCHINDUCTOR_CACHE_DIR unless the user set it


def resolve_graph_mode(mode: str, device: torch.device) -> str:
    """``"eager"`` or ``"compiled"`` for ``mode`` on ``device`` (``"auto"``: :data:`AUTO_GRAPH_MODE`)."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"graph_mode must be one of {', '.join(GRAPH_MODES)}; got {mode!r}")
    return AUTO_GRAPH_MODE.get(device.type, "eager") if mode == "auto" else mode


def resolve_capture_sizes(sizes: Sequence[int] | None, max_num_seqs: int) -> tuple[int, ...]:
    """The batch buckets, ascending: ``sizes``, or 1, 2, 4, ... and ``max_num_seqs`` itself when None.

    Raises ``ValueError`` naming a size that is not an int in ``[1, max_num_seqs]``."""
    if sizes is None:
        return tuple(sorted({min(1 << i, max_num_seqs) for i in range(max_num_seqs.bit_length() + 1)}))
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= max_num_seqs:
            raise ValueError(f"capture size {size!r} must be an int in [1, max_num_seqs={max_num_seqs}]")
    if not sizes:
        raise ValueError("capture_sizes is empty: give at least one batch size (or None for the default)")
    return tuple(sorted(set(sizes)))


def resolve_lookahead(
    setting: bool | None, device: torch.device, runner: GraphRunner | None, *, parallel: bool
) -> bool:
    """Whether an engine's chained draft proposes as a lookahead (``EngineConfig.lookahead``, `Engine._lookahead`):
    launched right after the verify, from its emitted tokens, before the host reads them.

    It needs graph mode's chain graph (a chained draft: EAGLE, EAGLE-3, MTP; one device). None turns it on on
    CUDA, where a graph-mode step is bound by the host and the lookahead takes the draft's batch and its staged copy
    off the host's path; on the CPU the host is the device, and its first pass over every verified position costs
    compute there (README, "Graph mode"). True without the chain graph raises ``ValueError``."""
    possible = runner is not None and runner.draft_chain is not None and not parallel
    if setting is None:
        return possible and device.type == "cuda"
    if setting and not possible:
        raise ValueError(
            "lookahead proposals run a chained draft's proposal as one graph: they need graph_mode='compiled', a "
            "chained draft (eagle, eagle3, mtp) and one device"
        )
    return setting


# Runs one shape's graph over its arguments (the buffers' views) and returns its outputs.
Graph = Callable[[tuple], object]


class GraphRunner:
    """Runs a target's (and a chained draft's) fixed-shape steps as graphs; everything else eagerly.

    :meth:`forward` has :meth:`Target.forward`'s contract and :meth:`draft_step` a chained draft's
    ``step`` (``DraftInput.step``). Both check and update the cache's host-side lengths exactly as
    the eager path does, then fill the buffers and run the shape's graph.

    Attributes:
        compile_s: seconds spent building graphs (compiling, or warm-up and capture on CUDA).
        graph_bytes: bytes held for graph mode: the buffers, and on CUDA the graphs' memory pool.
        fallbacks: forwards and draft steps that ran eagerly (prefills, too many rows).
        replays: forwards and draft steps that ran a graph.
    """

    SCRATCH_SLOTS = 1  # block-table rows past max_num_seqs that the engine allocates for padding rows

    def __init__(
        self,
        target,
        target_cache: KVCache,
        draft=None,
        draft_cache: KVCache | None = None,
        *,
        widths: Sequence[int],
        capture_sizes: Sequence[int],
        max_chain: int = 1,
        vocab_limit: int | None = None,
        backend: str | None = None,
    ):
        if not hasattr(target, "forward_layout"):
            raise ValueError(
                f"graph_mode='compiled' needs a target with forward_layout; {type(target).__name__} has none"
            )
        self.target, self.target_cache = target, target_cache
        self.draft, self.draft_cache = draft, draft_cache
        self.device = target_cache.layers[0].device
        self.cuda = self.device.type == "cuda"
        self.buckets, self.widths = tuple(sorted(capture_sizes)), tuple(sorted(set(widths)))
        self.scratch = target_cache.num_slots - self.SCRATCH_SLOTS
        self.table = target_cache.table
        # Data-parallel attention (DeepSeek-V3 over several ranks): this rank attends only the rows of its slots.
        self.data_parallel = getattr(target, "data_parallel_attention", False)
        self.owns = target.shard.owns_slot if self.data_parallel else lambda slot: True
        # torch.compile's backend: on the CPU the graphs', on CUDA the captured bodies' (None: eager kernels)
        if self.cuda:
            self.backend = backend or os.environ.get(CUDA_BACKEND_ENV) or None
        else:
            self.backend = backend or os.environ.get(BACKEND_ENV, "inductor")
        # Before inductor first asks for its cache (it would then fix its default under /tmp) and not at import:
        # setting it is graph mode's business, and a user's setting stands.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))
        tokens = self.buckets[-1] * self.widths[-1]
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        self.plan = torch.zeros(2 * tokens + self.buckets[-1], dtype=torch.int64, device=self.device)
        chained = draft is not None and draft_cache is not None and hasattr(draft, "step_layout")
        self.draft_step = self._draft_step if chained else None  # DraftInput.step: None keeps the draft's own
        # DraftInput.chain: a whole proposal in one graph (not over ranks: theirs follow the driver pass by pass)
        self.draft_chain = self._draft_chain if chained and not self.data_parallel else None
        self.max_chain = max_chain  # the longest proposal, in steps
        self.vocab_limit = vocab_limit  # the target's graphs choose its greedy tokens below it (None: every id)
        self.longest_chains = self.cuda  # every chain as long as the longest proposal (`_chain`)
        dtype = target_cache.layers[0].dtype  # the target's: its hidden states fill the draft's input buffer
        self.hidden = torch.zeros(tokens, target.hidden_size, dtype=dtype, device=self.device) if chained else None
        # A lookahead chain's start: each row's index, in its first pass, of the output the chain goes on from.
        self.chain_start = torch.zeros(self.buckets[-1], dtype=torch.int64, device=self.device) if chained else None
        self.graph_bytes = sum(
            t.numel() * t.element_size()
            for t in (self.input_ids, self.plan, self.hidden, self.chain_start)
            if t is not None
        )
        self.compile_s, self.fallbacks, self.replays = 0.0, 0, 0
        self._graphs: dict[tuple, Graph] = {}
        self._warm: set[tuple] = set()  # keys (less the CPU threads) whose body ran eagerly once
        self._staged: dict[tuple, Tensor] = {}  # plans sent ahead (stage_forward, stage_draft), by _plan_key
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None

    # ---------------------------------------------------------------- the two entry points
    def forward(
        self, batch: ForwardBatch, cache: KVCache, *, return_hidden: bool = False, return_aux: bool = False
    ) -> TargetOutput:
        """:meth:`Target.forward` of ``batch`` into ``cache`` (the target's), through a graph when it fits one."""
        shape = self._shape(batch.spans)
        if shape is None:
            self.fallbacks += 1
            return self.target.forward(batch, cache, return_hidden=return_hidden, return_aux=return_aux)
        cache.begin_forward(batch.spans)
        grid = self._load(batch, shape, cache.first_position)
        key = ("target", *shape, return_hidden, return_aux)
        body = self._target_body(return_hidden, return_aux)
        logits, greedy, hidden, aux = self._run(key, body, batch.spans, shape, cache, ())
        index = batch.logits_indices
        if grid is not None:
            index = grid if index is None else grid[index]
        return TargetOutput(
            logits=logits if index is None else logits[index],
            hidden=None if hidden is None else _rows(hidden, grid),
            aux_hidden=None if aux is None else _rows(aux, grid),
            greedy=greedy if index is None else greedy[index],
        )

    def _draft_step(self, batch: ForwardBatch, hidden: Tensor, cache: KVCache) -> Tensor:
        """A chained draft's ``step``: ``hidden [T, H]`` -> ``[T, H]``, through a graph when it fits one."""
        shape = self._shape(batch.spans)
        if shape is None:
            self.fallbacks += 1
            return self.draft.step(batch, hidden, cache)
        cache.begin_forward(batch.spans)
        grid = self._load(batch, shape, cache.first_position)
        inputs = self._hidden(hidden, shape, grid)
        out = self._run(("draft", *shape), self._draft_body(), batch.spans, shape, cache, (inputs,))
        return _rows(out, grid)

    def _draft_chain(
        self,
        batch: ForwardBatch,
        hidden: Tensor,
        cache: KVCache,
        k: int,
        vocab_limit: int | None = None,
        start: Tensor | None = None,
    ) -> Tensor | None:
        """A chained draft's whole greedy proposal (``tandem.models.drafts.chained.propose_chained`` without
        constraint or adjustments) as one graph: its first step over ``batch`` and ``hidden [T, H]``, then ``k - 1``
        steps of one token per row, each the argmax of the draft's ``target_logits`` over the last one's output
        (below ``vocab_limit``, None: every id); ``[B, k]`` int64, or None when the rows fit no bucket or ``k``
        exceeds :attr:`max_chain`. The chain may run further than ``k`` (:meth:`_chain`); its cache entries
        past the proposal are rewritten later.

        ``start [B]`` int64 on the device (a lookahead proposal): the chain goes on from each row's output at that
        index of its tokens instead of its last, at the position after it; the host's lengths are set as if it went
        on from the last (the furthest the chain may write), and the next proposal truncates them."""
        shape = self._shape(batch.spans)
        if shape is None or k > self.max_chain:
            return None
        rows = shape[0]
        chain = self._chain(batch.spans, k, cache)
        for spans in chain:
            cache.begin_forward(spans)
        grid = self._load(batch, shape, cache.first_position)
        extra = (self._hidden(hidden, shape, grid),)
        if start is not None:
            starts = self.chain_start[:rows]
            starts[batch.num_rows :].zero_()
            starts[: batch.num_rows].copy_(start)
            extra = (*extra, starts)
        key = ("chain", *shape, len(chain), vocab_limit, start is not None)
        body = self._chain_body(vocab_limit, len(chain), start is not None)
        tokens = self._run(key, body, chain[-1], shape, cache, extra)
        return tokens[: batch.num_rows, :k].clone()  # the graph's output buffer is rewritten at its next replay

    def _chain(self, spans: RowSpans, k: int, cache: KVCache) -> list[RowSpans]:
        """The steps' rows of a chain for a proposal of ``k`` over ``spans``: ``spans``, then a token per row past the
        last. ``k`` steps, or with :attr:`longest_chains` (CUDA) the longest the runner holds plans for, where every
        row's blocks hold its positions: one graph per length would multiply the captures (and the steps that
        capture), and a step costs the device little where the host bounds a proposal. On the CPU every step is
        compute."""
        steps, longest = k, self.max_chain
        if self.longest_chains and k != longest:
            room = [min(cache.max_len, cache.table.capacity(slot)) for slot in spans.slots]
            if all(end + longest - 1 <= top for end, top in zip(spans.ends(), room)):
                steps = longest
        chain = [spans]
        for _ in range(steps - 1):
            chain.append(chain[-1].following())
        return chain

    def _hidden(self, hidden: Tensor, shape: tuple[int, int], grid: Tensor | None) -> Tensor:
        """The draft's hidden-input buffer for ``shape``, filled with ``hidden [T, H]`` at the tokens' grid places."""
        inputs = self.hidden[: shape[0] * shape[1]]
        if grid is None:
            inputs.copy_(hidden)
        else:
            inputs[grid] = hidden.to(inputs.dtype)
        return inputs

    # ---------------------------------------------------------------- at start
    def capture(
        self,
        *,
        return_hidden: bool = False,
        return_aux: bool = False,
        vocab_limit: int | None = None,
        lookahead: bool = False,
    ) -> None:
        """Build ahead, before any request, the graphs a step replays (as vLLM captures at start), so that none is
        built while requests wait: at every bucket and width the target's forward (returning the hidden states
        the draft reads: ``return_hidden``, ``return_aux``) and a chained draft's step and whole proposal (its
        longest chain, below ``vocab_limit``, from each row's last token and, with ``lookahead``, from a start the
        device chose). They run over padding rows meanwhile (the scratch slot's block).

        On the CPU a graph is also specialised to the torch threads it runs with: these are built with the
        current ones, so steps that run with others (``EngineConfig.small_step_threads``) build theirs later."""
        target_body = self._target_body(return_hidden, return_aux)
        draft_body = None if self.draft_step is None else self._draft_body()
        chain = self.draft_chain is not None
        # The largest first, as vLLM captures: a smaller graph's capture reuses the pool memory a larger one freed.
        for shape in itertools.product(reversed(self.buckets), reversed(self.widths)):
            rows, width = shape
            padding = self._load_padding(shape, self.target_cache)
            self._run(("target", *shape, return_hidden, return_aux), target_body, padding, shape, self.target_cache, ())
            if draft_body is None:
                continue
            cache, hidden = self.draft_cache, self.hidden[: rows * width]
            padding = self._load_padding(shape, cache)
            self._run(("draft", *shape), draft_body, padding, shape, cache, (hidden,))
            for ahead in ((False, True) if lookahead else (False,)) if chain else ():
                starts = self.chain_start[:rows].zero_()
                key = ("chain", *shape, self.max_chain, vocab_limit, ahead)
                body = self._chain_body(vocab_limit, self.max_chain, ahead)
                self._run(key, body, padding, shape, cache, (hidden, starts) if ahead else (hidden,))

    def _load_padding(self, shape: tuple[int, int], cache: KVCache) -> RowSpans:
        """Fill the buffers with a step over ``cache`` of padding rows only; returns a padding row's span, which sets a
        compiled CPU graph's key window (:meth:`_run`): its one position."""
        plan = self._padding_plan(shape, cache.first_position)
        self.plan[: len(plan)].copy_(plan)
        return RowSpans([cache.first_position], [1], [self.scratch])

    def _padding_plan(self, shape: tuple[int, int], first_position: int) -> Tensor:
        """:meth:`_plan` of padding rows only (each reads and writes the scratch slot's block), on the host."""
        return torch.tensor(self._plan(RowSpans([], [], []), shape, first_position))

    # ---------------------------------------------------------------- host planning
    def stage_forward(self, spans: RowSpans, staging: Staging, lookahead: RowSpans | None = None) -> None:
        """Plan the target forward over ``spans`` ahead: its plan (and the block table, if it changed) travels in
        ``staging``'s copy, which must be sent before the forward. Replaces what was staged before. ``lookahead``:
        the rows of a lookahead proposal's first pass after it (the draft's), planned in the same copy."""
        self._stage([spans], self.target_cache, staging)
        if lookahead is not None:
            self._stage([lookahead], self.draft_cache, staging, keep=True)

    def stage_draft(self, spans: RowSpans, num_steps: int, staging: Staging, *, by_step: bool = False) -> None:
        """Plan ahead a chained proposal's ``num_steps`` draft steps (its chain's, :meth:`_chain`): the first
        over ``spans``, each next one a token per row past the last (``ForwardBatch.following``), as
        :meth:`stage_forward` does. The chain graph plans its steps after the first itself: those are planned here
        only for a proposal that runs step by step (``by_step``: rows with penalties choose each token on the host;
        no chain graph, or none holds the first step)."""
        if self.draft_step is None:  # a draft that is not chained runs no graph
            chain = []
        elif by_step or self.draft_chain is None or not self.fits(spans):
            chain = self._chain(spans, num_steps, self.draft_cache)
        else:
            chain = [spans]
        self._stage(chain, self.draft_cache, staging)

    def _stage(self, chain: list[RowSpans], cache: KVCache | None, staging: Staging, *, keep: bool = False) -> None:
        self.table.sync(staging)
        if not keep:
            self._staged = {}
        for spans in chain:
            shape = self._shape(spans)
            if shape is not None:
                key = self._plan_key(spans, cache.first_position)
                self._staged[key] = staging.int64(self._plan(spans, shape, cache.first_position))

    def _plan_key(self, spans: RowSpans, first_position: int) -> tuple:
        """What a plan depends on: the rows, the cache's first position and the block table's rows."""
        return tuple(spans.starts), tuple(spans.lengths), tuple(spans.slots), first_position, self.table.version

    def fits(self, spans: RowSpans) -> bool:
        """Whether a forward or a draft step over ``spans`` runs a graph (a bucket and a width hold its rows)."""
        return self._shape(spans) is not None

    def _shape(self, spans: RowSpans) -> tuple[int, int] | None:
        """``(bucket, width)`` of a step with these rows, or None when none fits."""
        rows, longest = len(spans.slots), max(spans.lengths)
        bucket = next((b for b in self.buckets if b >= rows), None)
        width = next((w for w in self.widths if w >= longest), None)
        return None if bucket is None or width is None else (bucket, width)

    def _plan(self, spans: RowSpans, shape: tuple[int, int], first_position: int) -> list[int]:
        """The buffers' values for rows ``spans`` padded to ``shape``: positions ``[B_bucket * Q]``, write indices
        ``[B_bucket * Q]``, slots ``[B_bucket]``, then, unless the batch fills the grid in order, each token's
        index in the grid ``[T]``.

        A padding token repeats its row's last position and writes to the scratch block; a padding
        row reads the scratch slot's blocks (the scratch block) at ``first_position``, the one key it
        writes there itself. Under data-parallel attention a row this rank does not own is planned as a padding
        row: its blocks are another rank's (its table may hold ids of another domain's pool), so it reads and
        writes the scratch block only, and its slot is the scratch slot (:meth:`_owned`)."""
        (rows, width), table = shape, self.table
        scratch = table.scratch_block * table.block_size
        positions, writes, grid = [], [], []
        for b, (start, n, slot) in enumerate(zip(spans.starts, spans.lengths, spans.slots)):
            grid += range(b * width, b * width + n)
            if not self.owns(slot):
                positions += [first_position] * width
                writes += [scratch + first_position % table.block_size] * width
                continue
            positions += [start + min(j, n - 1) for j in range(width)]
            writes += [table.flat_index(slot, p) for p in range(start, start + n)]
            writes += [scratch + (start + n - 1) % table.block_size] * (width - n)
        padding = (rows - len(spans.slots)) * width
        positions += [first_position] * padding
        writes += [scratch + first_position % table.block_size] * padding
        slots = [slot if self.owns(slot) else self.scratch for slot in spans.slots]
        slots += [self.scratch] * (rows - len(spans.slots))
        return positions + writes + slots + ([] if len(grid) == rows * width else grid)

    def _load(self, batch: ForwardBatch, shape: tuple[int, int], first_position: int) -> Tensor | None:
        """Fill the buffers for ``batch`` padded to ``shape``; returns each token's index in the grid ``[T]``
        (None when the batch fills the grid in order). Its plan was sent ahead (:meth:`stage_forward`,
        :meth:`stage_draft`), or goes now in one copy; no device read."""
        rows, width = shape
        plan = self._plan_tensor(batch.spans, shape, first_position)
        size = 2 * rows * width + rows
        self.plan[:size].copy_(plan[:size])
        ids = self.input_ids[: rows * width]
        if len(plan) == size:
            ids.copy_(batch.input_ids)
            return None
        index = plan[size:]
        ids[index] = batch.input_ids
        return index

    def _plan_tensor(self, spans: RowSpans, shape: tuple[int, int], first_position: int) -> Tensor:
        """The plan of a forward over ``spans`` padded to ``shape`` on the device: the one sent ahead, or sent now."""
        plan = self._staged.pop(self._plan_key(spans, first_position), None)
        if plan is None:
            staging = Staging(self.device)
            self.table.sync(staging)
            plan = staging.int64(self._plan(spans, shape, first_position))
            staging.send()
        return plan

    # ---------------------------------------------------------------- graphs
    def _target_body(self, return_hidden: bool, return_aux: bool) -> Callable:
        target, vocab_limit = self.target, self.vocab_limit

        def body(input_ids, positions, write_index, slots, tables, layers, key_start: int, block_size: int):
            """The forward's outputs, and its greedy tokens inside the graph: a greedy step without masks or
            adjustments then launches no sampling kernel of its own (`TargetOutput.greedy`)."""
            layout = RaggedLayout.static(positions, write_index, tables.index_select(0, slots), key_start, block_size)
            owned = self._owned(slots, positions.shape[1])
            out = target.forward_layout(
                layout, input_ids, positions.flatten(), layers, None, return_hidden, return_aux, **owned
            )
            return out.logits, _greedy(out.logits, vocab_limit), out.hidden, out.aux_hidden

        return body

    def _draft_body(self) -> Callable:
        draft = self.draft

        def body(input_ids, positions, write_index, slots, tables, layers, key_start: int, block_size: int, hidden):
            layout = RaggedLayout.static(positions, write_index, tables.index_select(0, slots), key_start, block_size)
            owned = self._owned(slots, positions.shape[1])
            return draft.step_layout(layout, input_ids, positions.flatten(), hidden, layers, **owned)

        return body

    def _chain_body(self, vocab_limit: int | None, steps: int, lookahead: bool) -> Callable:
        draft = self.draft

        def body(input_ids, positions, write_index, slots, tables, layers, key_start, block_size, hidden, *start):
            """The first step over the grid ``[B_bucket, Q]``, then ``steps - 1`` of one token per row. The chain goes
            on from each row's output at ``start [B_bucket]`` (a lookahead's), else at its last token (its positions
            rise to the last real one: the first maximum); each next step at the position after the last, written
            where the row's blocks put it (past them, and a padding row's: the scratch block, which a row's table
            holds there)."""
            rows, width = positions.shape
            row_tables = tables.index_select(0, slots)
            layout = RaggedLayout.static(positions, write_index, row_tables, key_start, block_size)
            out = draft.step_layout(layout, input_ids, positions.flatten(), hidden, layers)
            offsets = start[0] if lookahead else positions.argmax(dim=1)
            last = offsets + torch.arange(rows, device=positions.device) * width
            h, position, tokens = out[last], positions.flatten()[last], []
            for step in range(steps):
                tokens.append(_greedy(draft.target_logits(h), vocab_limit))
                if step + 1 < steps:
                    position = position + 1
                    block = (position // block_size).clamp(max=tables.shape[1] - 1)
                    writes = row_tables.gather(1, block[:, None])[:, 0] * block_size + position % block_size
                    layout = RaggedLayout.static(position[:, None], writes, row_tables, key_start, block_size)
                    h = draft.step_layout(layout, tokens[-1], position, h, layers)
            return torch.stack(tokens, dim=1)

        return body

    def _owned(self, slots: Tensor, width: int) -> dict[str, Tensor]:
        """A body's ``owned`` argument under data-parallel attention: ``[B * Q] bool``, the tokens of the rows this
        rank attends, read from the slots buffer ``[B]`` (:meth:`_plan` gives the others the scratch slot, padding
        rows' too), so a graph serves whatever rows a rank owns at a step. The provider zeroes the others'
        attention outputs before the all-reduce that sums the ranks' rows. Else no argument."""
        if not self.data_parallel:
            return {}
        return {"owned": (slots != self.scratch)[:, None].expand(-1, width).flatten()}

    def _run(self, key: tuple, body: Callable, spans: RowSpans, shape: tuple[int, int], cache: KVCache, extra):
        """Run ``key``'s graph of ``body`` over the buffers (building it on first use); returns its outputs.

        The key window: a CUDA graph's is fixed, every row's whole block table; a compiled CPU graph's is the
        blocks up to the furthest position of the rows ``spans`` (a chain's last step's), at least two (a size of 1
        would specialise the graph). A compiled graph is specialised to the torch threads it ran with (the engine
        runs larger steps on more), so they are part of its key; its body's eager warm-up runs once per key less
        them: over several ranks every rank must run a step's collectives as often as the others, whatever threads
        it runs with."""
        table = self.table
        blocks = min(max(-(-max(spans.ends()) // table.block_size), 2), table.max_blocks)
        args = self._args(shape, cache, table.max_blocks if self.cuda else blocks, extra)
        warm = key
        if not self.cuda:
            key = (*key, torch.get_num_threads())
        graph = self._graphs.get(key)
        if graph is not None:
            self.replays += 1
            return graph(args)
        began = time.perf_counter()
        with graph_attention():  # CUDA attention only
            if warm not in self._warm:
                # Warm-up over whole rows: state built on demand (the rotary tables, to max_len) exists before
                # tracing or capture, and no later eager step (a longer prefill) rebuilds what a graph reads.
                body(*self._args(shape, cache, table.max_blocks, extra))
                self._warm.add(warm)
            self._graphs[key], out = self._build(body, args)
        self.compile_s += time.perf_counter() - began
        return out

    def _args(self, shape: tuple[int, int], cache: KVCache, blocks: int, extra: tuple) -> tuple:
        """A body's arguments: views of the buffers for ``shape``, each row's first ``blocks`` blocks."""
        rows, width = shape
        tokens = rows * width
        plan = self.plan
        return (
            self.input_ids[:tokens],
            plan[:tokens].view(rows, width),
            plan[tokens : 2 * tokens],
            plan[2 * tokens : 2 * tokens + rows],
            self.table.tensor[:, :blocks],
            cache.layers,
            cache.first_position,
            self.table.block_size,
            *extra,
        )

    def _build(self, body: Callable, args: tuple) -> tuple[Callable, object]:
        """The graph of ``body`` over ``args`` (the buffers' views) and its first outputs."""
        if not self.cuda:
            compiled = _compiled(body, self.backend)

            def run(current: tuple):
                # Marked at every call: a graph dynamo ever rebuilds (a guard failed) keeps the window dynamic.
                torch._dynamo.maybe_mark_dynamic(current[4], 1)
                return compiled(*current)

            out = run(args)

            return run, out
        if self.backend is not None:
            body = _compiled(body, self.backend)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            body(*args)  # compiles, where it is compiled (and tunes its kernels)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # Capture starts by releasing the allocator's unused cache (an earlier engine's freed memory, say), which
        # would come off the pool's growth: release it first. (No garbage collection here: with a large heap one costs
        # more than a capture.)
        torch.cuda.empty_cache()
        graph, reserved = torch.cuda.CUDAGraph(), torch.cuda.memory_reserved(self.device)
        with torch.cuda.graph(graph, pool=self._pool):
            out = body(*args)
        self.graph_bytes += torch.cuda.memory_reserved(self.device) - reserved
        graph.replay()

        def replay(_: tuple):
            graph.replay()
            return out

        return replay, out


def _greedy(logits: Tensor, vocab_limit: int | None) -> Tensor:
    """``logits [N, V]``' greedy tokens ``[N]`` inside a graph: each row's argmax below ``vocab_limit`` (the ids from
    there up set to -inf in place), the lowest id among ties as the eager paths' ``decoding.sampling.argmax``."""
    return forbid_ids_from(logits, vocab_limit).argmax(dim=-1)


def _rows(out: Tensor, grid: Tensor | None) -> Tensor:
    """The batch's tokens ``[T, ...]`` of a graph's grid output ``[B_bucket * Q, ...]``."""
    return out if grid is None else out[grid]


def _compiled(body: Callable, backend: str) -> Callable:
    """``body`` compiled whole (``fullgraph``: a graph break fails) by ``backend``, under :func:`_static_shapes`."""
    compiled = torch.compile(body, fullgraph=True, backend=backend)

    def run(*args):
        with _static_shapes():
            return compiled(*args)

    return run


def _static_shapes():
    """Dynamo's settings for the runner's graphs: no automatic dynamic shapes (a second bucket must not make
    the batch size dynamic: each shape is its own graph), and room for every runner's shapes, which share
    one code object's cache of graphs."""
    return torch._dynamo.config.patch(
        automatic_dynamic_shapes=False, recompile_limit=1024, accumulated_recompile_limit=4096
    )
