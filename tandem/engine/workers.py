"""One engine over several processes: the driver keeps the engine, worker ranks run the forwards it sends them.

The split is vLLM's executor's. The driver (rank 0, the process that built ``tandem.LLM`` or serves HTTP) keeps the
scheduler, the grammar walks, acceptance and the commits; it holds rank 0's shard of the target. Every
target forward it runs is first described to the worker ranks (:meth:`Workers.forward`): the batch's rows on the
host, the cache's lengths and block table, what to return; its token ids go by a broadcast on the device group
(NCCL on CUDA, gloo on the CPU), so the driver reads nothing back. Each rank then runs the same provider forward
on its own shard and its own KV cache (SPMD); the collectives inside the model (``tandem.models.parallel``) line
the ranks up, and the logits every rank ends with are the whole ``[N, V]``. In graph mode each rank runs the
forwards (and a draft's steps) through a graph runner of its own (:mod:`tandem.engine.graphs`), which builds and
replays the same shapes' graphs at the same steps as the driver's, collectives inside. Only the driver decides
anything (acceptance, sampling, the grammar), and the workers hold no request state: the tokens it commits reach
them as the next forward's input, so no rank can drift.

A draft that follows the target's layout (DeepSeek-V3's MTP layer, built with the target's shard) runs on every
rank the same way: each rank loads its part (:meth:`Workers.load_draft`) and mirrors the draft cache
(:meth:`Workers.mirror_draft`); before each proposal the driver describes it (:meth:`Workers.propose`: the rows'
spans, the draft cache's lengths; the hidden states are those of the forward just run, which every rank holds)
and every rank runs its steps, the first over the committed tokens (their ids broadcast), then one per chained
position, for which only the ``[B]`` tokens the driver chose (under the grammar) are broadcast. Only the driver
reads the draft's head. Llama's EAGLE / EAGLE-3 drafts run whole on the driver: one small layer over the whole
embedding and LM head that rank 0 keeps, where a tensor-parallel one would cost those same messages per chained
position and an all-reduce per layer for a model a fraction of the target's size.

Processes: :meth:`Workers.start` spawns ``world_size - 1`` workers with torch.multiprocessing (or, under
``torchrun``, where every rank is started for it, joins the group of this engine's ranks, :func:`_join_launch`:
every rank, or one engine replica's; the engine's driver runs the program, the others call :func:`follow`, and
they serve the driver's engines until its process exits). Control messages are pickled over a gloo group of
their own. Failure: a rank that dies, or a message or collective that waits past ``ParallelConfig.timeout_s``,
ends the engine with :class:`WorkerError` naming the rank: its exit code, the traceback it sent, or (a rank that
stopped answering) how many of the forwards sent it finished, which every rank counts in the process group's
store (:func:`_progress`; spawned or started by ``torchrun``, on this node or another).
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import itertools
import os
import pickle
import socket
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from tandem.core.transfer import int64_tensor
from tandem.models.base import (
    BlockTable,
    Draft,
    DraftInput,
    DraftProposal,
    ForwardBatch,
    KVCache,
    RowSpans,
    TargetOutput,
)
from tandem.models.drafts.chained import follow_chained
from tandem.models.loading import TARGET_MODULES
from tandem.models.parallel import Shard

LAUNCH_STORE_TIMEOUT = datetime.timedelta(minutes=10)  # a rank waits for another's key this long (an engine's build)
SPAWN_TIMEOUT_S = 120.0  # spawned ranks wait at least this long for each other to join (`_spawn_store`)
JOIN_POLL_S = 0.05  # how often the driver looks for spawned ranks that joined or died (`_await_spawned`)


class WorkerError(RuntimeError):
    """A worker rank died, failed or stopped answering; the engine cannot go on."""


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes run the target, and how it is split over them.

    Llama 3: ``tensor_parallel_size`` ranks split heads, MLP columns and the vocabulary. DeepSeek-V3:
    ``data_parallel_size`` ranks run attention data-parallel (each its rows) with dense layers and shared experts
    split by columns, and routed experts whole per rank when ``enable_expert_parallel`` (else split by columns).
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    timeout_s: float = 120.0  # a collective waiting longer than this ends the engine

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def timeout(self) -> datetime.timedelta:
        """``timeout_s`` as the process groups and waits take it."""
        return datetime.timedelta(seconds=self.timeout_s)

    def check(self, config: dict[str, Any], device: torch.device) -> None:
        """Raise ValueError, before any process starts or weight is read, for a layout tandem cannot run on the
        model of ``config`` (its ``config.json``) and ``device``. Every layout runs in either graph mode: each
        rank captures its own graphs (under data-parallel attention over the whole padded batch,
        :mod:`tandem.engine.graphs`)."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        model_type = config.get("model_type", "<none>")
        if tp < 1 or dp < 1:
            raise ValueError(f"tensor_parallel_size {tp} and data_parallel_size {dp} must be at least 1")
        if self.timeout_s <= 0:
            raise ValueError(f"ParallelConfig.timeout_s = {self.timeout_s} must be positive")
        if model_type == "llama" and dp > 1:
            raise ValueError(
                f"data_parallel_size {dp} for a Llama model means engine replicas (tandem.engine.replicas), not "
                "ranks of one engine"
            )
        if model_type == "deepseek_v3" and tp > 1:
            raise ValueError(
                f"tensor_parallel_size {tp} for DeepSeek-V3: tandem runs its MLA attention data-parallel, as the "
                "peers serve it: use data_parallel_size (with enable_expert_parallel for whole experts per rank)"
            )
        if model_type not in ("llama", "deepseek_v3") and self.world_size > 1:
            raise ValueError(f"model_type {model_type!r} has no parallel layout in tandem")
        if self.enable_expert_parallel and model_type != "deepseek_v3":
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model, not {model_type!r}")
        if self.world_size > 1:  # the provider's own refusals of the sizes its layout splits
            module, config_class = TARGET_MODULES[model_type]
            importlib.import_module(module).check_shard(config_class.from_dict(config), self.shard(0, model_type))
        here = self.world_size
        if launched():  # a GPU per rank on this node; on the CPU the ranks of other engines (replicas) share the cores
            world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            if world != self.world_size and (model_type != "llama" or world % self.world_size):
                raise ValueError(
                    f"torchrun started {world} ranks, but tensor_parallel_size {tp} x data_parallel_size {dp} = "
                    f"{self.world_size}" + (" (or, engine replicas, a multiple of it)" if model_type == "llama" else "")
                )
            here = local if device.type == "cuda" else min(local, self.world_size)
        available, what = devices_here(device)
        first = (device.index or 0) if device.type == "cuda" and not launched() else 0  # rank r: cuda:<first + r>
        if first + here > available:
            start = f" from cuda:{first}" if first else ""
            raise ValueError(f"{here} ranks on this machine{start} (tp {tp} x dp {dp}) but it has {available} {what}")

    def shard(self, rank: int, model_type: str) -> Shard:
        """Rank ``rank``'s place in the model's layout (over the default process group)."""
        if model_type == "deepseek_v3":
            return Shard(
                rank,
                self.world_size,
                data_parallel_attention=self.world_size > 1,
                expert_parallel=self.enable_expert_parallel,
            )
        return Shard(rank, self.world_size)


@dataclass(frozen=True)
class CacheLayout:
    """What a worker needs to build a cache that mirrors the driver's: the block table's geometry and, in graph
    mode, the graph runner's widths and batch buckets (None: eager)."""

    num_slots: int
    max_len: int
    block_size: int
    num_blocks: int  # a rank's pool: under data-parallel attention its rows' domain's (engine/kv_blocks.py)
    scratch_block: int
    widths: tuple[int, ...] | None = None
    capture_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Load:
    """Engine ``engine``'s target: each rank builds its shard of the checkpoint at ``path``."""

    engine: int
    path: Path
    model_type: str
    dtype: torch.dtype | None
    narrow: bool  # store bfloat16-exact weights narrower (the CPU float32 fast path)


@dataclass(frozen=True)
class _LoadDraft:
    """Engine ``engine``'s draft: each rank builds its part of the draft ``source`` (``tandem.llm.resolve_draft``'s)
    beside its target shard."""

    engine: int
    source: str | Path
    dtype: torch.dtype | None
    narrow: bool


@dataclass(frozen=True)
class _Mirror:
    """Engine ``engine``'s cache (and graph runner), laid out as the driver's."""

    engine: int
    layout: CacheLayout


@dataclass(frozen=True)
class _MirrorDraft:
    """Engine ``engine``'s draft cache, over the same block table as its target cache (as the driver's)."""

    engine: int


@dataclass(frozen=True)
class _Release:
    """Engine ``engine`` closed: its target and cache go."""

    engine: int


@dataclass(frozen=True)
class _Forward:
    """A target forward of engine ``engine``: the rows (their ids follow by broadcast), the cache state the driver
    had before it."""

    engine: int
    spans: RowSpans
    num_logits: int | None  # logits indices follow by broadcast (None: every token)
    lengths: list[int]
    table: tuple[list[list[int]], list[int]] | None  # the block table's rows and read-only prefixes, when changed
    return_hidden: bool
    return_aux: bool


@dataclass(frozen=True)
class _Draft:
    """A draft proposal of engine ``engine`` of ``num_tokens`` chained positions: the rows of its first step (their
    ids follow by broadcast, then each chained position's ``[B]`` tokens), the draft cache's lengths the driver had
    before it. Its hidden states are the last forward's, at the tokens before these (:func:`_hidden_rows`)."""

    engine: int
    spans: RowSpans
    lengths: list[int]
    table: tuple[list[list[int]], list[int]] | None  # as in _Forward
    num_tokens: int
    graphs: bool  # whether the driver runs the steps through its graph runner, as this rank must then


def devices_here(device: torch.device) -> tuple[int, str]:
    """How many processes of ``device``'s type this machine runs side by side (its GPUs, else its CPU cores),
    and what they are called."""
    if device.type == "cuda":
        return torch.cuda.device_count(), "GPUs"
    return os.cpu_count() or 1, "CPU cores"


def launched() -> bool:
    """Whether a launcher (``torchrun``) started this process as one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_group_names() -> None:
    """Name this process's next process groups as a fresh process names them, where no group is alive. torch names
    its groups by a counter (their keys in the ranks' store follow the name) that `destroy_process_group` resets but
    a failed `init_process_group` leaves a step ahead: the next ranks started from this process would otherwise wait
    for each other under different keys until their timeout."""
    distributed_c10d._world.group_count = 0


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _progress() -> dist.Store:
    """Where each rank counts the forwards it finished, under its rank: the default group's store, which every rank
    reaches (hosted by the driver, or by ``torchrun``'s agent), so the driver can name the rank behind on any node.
    A worker sets its count to 0 before it takes a message: a store that outlives a group (``torchrun``'s) keeps
    the counts of an earlier one."""
    return dist.PrefixStore("tandem/forwards/", distributed_c10d._get_default_store())


def _control_group() -> dist.ProcessGroup:
    """The gloo group control messages go over. Its timeout is long: a worker waits on it for the driver's next
    message however long the engine idles; a rank that dies still breaks it at once, and the driver bounds its
    own waits on it (:func:`_broadcast`, ``ParallelConfig.timeout_s``), so one that hangs is caught too."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


def _broadcast(message: Any, group: dist.ProcessGroup, timeout: datetime.timedelta | None) -> Any:
    """Rank 0's ``message`` on every rank, pickled over ``group``. Rank 0 waits at most ``timeout`` for the others
    to take it (a stopped rank would hold a send forever); the others wait as long as the group allows."""
    source = dist.get_rank() == 0
    data = bytearray(pickle.dumps(message) if source else b"")
    size = torch.tensor([len(data)], dtype=torch.int64)
    _wait(dist.broadcast(size, src=0, group=group, async_op=True), timeout)
    payload = torch.frombuffer(data, dtype=torch.uint8) if source else torch.empty(int(size), dtype=torch.uint8)
    _wait(dist.broadcast(payload, src=0, group=group, async_op=True), timeout)
    return message if source else pickle.loads(payload.numpy().tobytes())


def _wait(work: dist.Work, timeout: datetime.timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of ``rank`` on its node, ``device`` being rank 0's: under ``torchrun`` ``cuda:<local rank>``,
    else ``cuda:<rank 0's index + rank>`` (a tensor-parallel engine replica's ranks take the GPUs after its
    first); the CPU otherwise."""
    if device.type != "cuda":
        return device
    if launched():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return torch.device("cuda", (device.index or 0) + rank)


class _Ranks:
    """The worker processes and the process group of this driver process, shared by its parallel engines (the
    bench holds several at once); the last engine to close shuts them down."""

    running: _Ranks | None = None

    def __init__(self, parallel: ParallelConfig, device: torch.device, processes, errors) -> None:
        self.parallel, self.device = parallel, device
        self.processes, self.errors = processes, errors
        self.progress = _progress()  # each rank's finished forwards
        self.forwards = 0  # forwards sent (or being sent)
        self.control = _control_group()
        self.engines = itertools.count()
        self.users = 0
        self.closed = False

    @classmethod
    def get(cls, parallel: ParallelConfig, device: torch.device) -> _Ranks:
        """The running ranks of this layout, else new ones: spawned workers, or ``torchrun``'s group joined."""
        running = cls.running
        if running is not None and not running.closed:
            if (running.parallel, running.device) != (parallel, device):
                raise ValueError(
                    f"this process runs {running.parallel} on {running.device} already: close() those LLMs first"
                )
            return running
        if running is not None and launched():  # shut down after a failure: its ranks left and cannot come back
            raise WorkerError(
                "torchrun's ranks were shut down after a failure and cannot be started again: rerun the job"
            )
        processes, errors = [], None
        if not dist.is_initialized():
            _reset_group_names()
        if launched():  # torchrun started every rank
            _join_launch(parallel, device)
        else:
            context = mp.get_context("spawn")
            errors = context.SimpleQueue()
            port = _free_port()
            processes = [
                context.Process(
                    target=_spawned_worker,
                    args=(rank, parallel, device, port, errors),
                    name=f"tandem-rank{rank}",
                    daemon=True,
                )
                for rank in range(1, parallel.world_size)
            ]
            for process in processes:
                process.start()
            if device.type == "cuda" and device.index is not None:  # a replica's driver: NCCL's current device
                torch.cuda.set_device(device)
            store = _spawn_store(port, 0, parallel)
            _await_spawned(store, processes, errors, parallel)
            dist.init_process_group(
                _backend(device), store=store, rank=0, world_size=parallel.world_size, timeout=parallel.timeout
            )
        cls.running = cls(parallel, device, processes, errors)
        if launched():  # torchrun's ranks cannot be started again: they serve this process until it exits
            atexit.register(cls.running.shutdown)
        return cls.running

    def send(self, message: Any) -> None:
        self.guarded(_broadcast, message, self.control, self.parallel.timeout)

    def guarded(self, run, *args, **kwargs):
        """``run(*args, **kwargs)``, its distributed failures turned into :class:`WorkerError` naming the rank."""
        if self.closed:
            raise WorkerError("the worker ranks were shut down")
        try:
            return run(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as error:
            raise WorkerError(self._diagnose(error)) from error

    def _diagnose(self, error: BaseException) -> str:
        """Which rank failed and how: the traceback it sent, its exit code (a spawned rank), or (a collective that
        timed out) the ranks that did not finish every forward sent."""
        for process in self.processes:
            process.join(timeout=1)
        processes = enumerate(self.processes, 1)
        failures = [f"rank {r} exited with code {p.exitcode}" for r, p in processes if not p.is_alive()]
        failures += _sent_tracebacks(self.errors)
        if not failures:
            failures = [
                f"rank {r} stopped answering after {finished} of the {self.forwards} forwards sent ({error})"
                for r, finished in self._finished().items()
                if finished < self.forwards
            ]
        self.shutdown()
        if failures:
            return "; ".join(failures)
        timeout = self.parallel.timeout_s
        return f"a collective failed or waited past timeout_s={timeout} s with every rank alive ({error})"

    def _finished(self) -> dict[int, int]:
        """Each worker rank's finished forwards, as it counted them (:func:`_progress`); none when the store
        cannot be read (its host is gone)."""
        try:
            return {r: self.progress.add(str(r), 0) for r in range(1, self.parallel.world_size)}
        except RuntimeError:
            return {}

    def shutdown(self) -> None:
        """Stop the workers (they leave their loop), wait for them and end the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            _broadcast(None, self.control, self.parallel.timeout)
            told = True
        except RuntimeError:  # a worker is gone or stuck: the kill below ends it
            told = False
        for process in self.processes:
            process.join(timeout=10 if told else 0)
            if process.is_alive():
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


class Workers:
    """One engine's target (and a draft in its layout) on the worker ranks (see the module docstring): each rank
    loads its shard, mirrors the driver's caches and runs the forwards :meth:`forward` and the proposals
    :meth:`propose` describe. Build it with :meth:`start`."""

    def __init__(self, ranks: _Ranks, model_type: str) -> None:
        self.ranks, self.id = ranks, next(ranks.engines)
        self.shard = ranks.parallel.shard(0, model_type)  # the driver's
        self.has_draft = False  # whether the ranks run the draft's proposals too (:meth:`load_draft`)
        self._cache: KVCache | None = None
        self._table_version = -1
        self.closed = False

    @classmethod
    def start(
        cls,
        parallel: ParallelConfig,
        config: dict[str, Any],
        device: torch.device | str,
        path: Path,
        dtype: torch.dtype | None,
        narrow: bool,
    ) -> Workers:
        """Have every worker rank load its shard of the target at ``path`` (``config``: its ``config.json``;
        ``narrow``: store bfloat16-exact weights narrower, as the driver does), starting the ranks first unless
        this process runs them already (``parallel`` checked: :meth:`ParallelConfig.check`). The driver then loads
        its own shard, :attr:`shard`."""
        device = torch.device(device)
        ranks = _Ranks.get(parallel, device)
        workers = cls(ranks, config["model_type"])
        ranks.send(_Load(workers.id, Path(path), config["model_type"], dtype, narrow))
        ranks.users += 1
        return workers

    @property
    def processes(self) -> list:
        """The worker processes this driver spawned (none under ``torchrun``)."""
        return self.ranks.processes

    def load_draft(self, source: str | Path, dtype: torch.dtype | None, narrow: bool) -> None:
        """Have every worker build its part of the draft ``source`` (``tandem.llm.resolve_draft``'s: ``"mtp"`` or a
        NextN checkpoint) beside its target shard, as the driver built its own: a draft whose layer follows the
        target's layout, whose proposals then run on every rank (:meth:`propose`)."""
        self.ranks.send(_LoadDraft(self.id, source, dtype, narrow))
        self.has_draft = True

    def mirror(self, cache: KVCache, layout: CacheLayout) -> None:
        """Have every worker build a target cache like the driver's ``cache`` (and a graph runner in graph mode)."""
        self._cache = cache
        self.ranks.send(_Mirror(self.id, layout))

    def mirror_draft(self) -> None:
        """Have every worker build a draft cache over its target cache's block table, as the driver's shares its
        target's (after :meth:`load_draft` and :meth:`mirror`)."""
        self.ranks.send(_MirrorDraft(self.id))

    def forward(self, batch: ForwardBatch, *, return_hidden: bool, return_aux: bool) -> None:
        """Send the workers the forward of ``batch`` into their caches, as the driver is about to run it."""
        num_logits = None if batch.logits_indices is None else len(batch.logits_indices)
        lengths, rows = list(self._cache.lengths), self._table_rows()
        self._send_counted(_Forward(self.id, batch.spans, num_logits, lengths, rows, return_hidden, return_aux))
        self.ranks.guarded(dist.broadcast, batch.input_ids, src=0)
        if batch.logits_indices is not None:
            self.ranks.guarded(dist.broadcast, batch.logits_indices, src=0)

    def propose(self, draft: Draft, inp: DraftInput, cache: KVCache, num_tokens: int) -> DraftProposal:
        """``draft.propose(inp, cache, num_tokens)`` on every rank, right after the target forward whose hidden
        states ``inp`` reads (``draft``: a chained draft, with a ``step``, that :meth:`load_draft` loaded on the
        workers; ``cache``: mirrored by :meth:`mirror_draft`). Each step's ids reach the workers before the driver
        runs it (the committed tokens, then each chained position's ``[B]`` chosen ones); its distributed failures
        end in :class:`WorkerError`."""
        spans, lengths = inp.batch.spans, list(cache.lengths)
        graphs = inp.step is not None  # the graph runner's steps (an eager pass, a chunk's fill, has none)
        self._send_counted(_Draft(self.id, spans, lengths, self._table_rows(), num_tokens, graphs))
        run = inp.step or draft.step

        def step(batch: ForwardBatch, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
            dist.broadcast(batch.input_ids.contiguous(), src=0)  # a chained step's ids: a column of [B, k] tokens
            return run(batch, hidden, cache)

        # Step by step (no chain graph): each step's ids go to the ranks before it runs.
        return self.ranks.guarded(draft.propose, replace(inp, step=step, chain=None), cache, num_tokens)

    def _send_counted(self, message: _Forward | _Draft) -> None:
        # Counted before it is sent: a rank that never takes it is behind. A proposal counts as one forward.
        self.ranks.forwards += 1
        self.ranks.send(message)

    def _table_rows(self) -> tuple[list[list[int]], list[int]] | None:
        """The block table's rows and read-only prefixes (shared by the target and draft caches) when they changed
        since the workers last had them, else None."""
        table = self._cache.table
        if table.version == self._table_version:
            return None
        self._table_version = table.version
        return table.rows, table.read_only

    def guard(self, run, *args, **kwargs):
        """``run(*args, **kwargs)`` (the driver's part of a forward, which takes part in collectives), its
        distributed failures turned into :class:`WorkerError` naming the rank."""
        return self.ranks.guarded(run, *args, **kwargs)

    def close(self) -> None:
        """Free this target on the workers; the last engine of the process stops them, unless ``torchrun`` started
        them (they then serve this process's later engines, and stop at its exit). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.ranks.users -= 1
        if (self.ranks.users > 0 or launched()) and not self.ranks.closed:
            try:
                self.ranks.send(_Release(self.id))
                return
            except WorkerError:
                pass
        self.ranks.shutdown()


# -------------------------------------------------------------------- the worker side
def _sent_tracebacks(errors) -> list[str]:
    """``rank r failed:`` and its traceback, for each one spawned ranks put on the ``errors`` queue (None: none)."""
    failures = []
    while errors is not None and not errors.empty():
        rank, trace = errors.get()
        failures.append(f"rank {rank} failed:\n{trace}")
    return failures


def _spawn_wait_s(parallel: ParallelConfig) -> float:
    """How long spawned ranks wait for each other to join (:func:`_spawn_store`)."""
    return max(parallel.timeout_s, SPAWN_TIMEOUT_S)


def _spawn_store(port: int, rank: int, parallel: ParallelConfig) -> dist.TCPStore:
    """The store a spawned engine's ranks meet at, on this host's ``port``: rank 0 hosts it and returns at once
    (:func:`_await_spawned` waits for the others), a worker rank joins it and says so. Its waits last at least
    :data:`SPAWN_TIMEOUT_S`, whatever ``timeout_s`` bounds the collectives with: a spawned rank starts a Python
    process and imports torch before it joins, which a busy machine may take longer than a collective's timeout."""
    timeout = datetime.timedelta(seconds=_spawn_wait_s(parallel))
    host = rank == 0
    store = dist.TCPStore(
        "127.0.0.1", port, parallel.world_size, is_master=host, wait_for_workers=False, timeout=timeout
    )
    if not host:
        store.set(f"tandem/joined/{rank}", "1")
    return store


def _await_spawned(store: dist.Store, processes: list, errors, parallel: ParallelConfig) -> None:
    """Wait until every spawned rank (``processes[r - 1]`` is rank r) has joined ``store``. A rank that exits first
    (its traceback on the ``errors`` queue, where it could send one), or ranks still away after
    :func:`_spawn_wait_s`, stop them all and raise :class:`WorkerError` naming the ranks, instead of the group's
    start waiting them out."""
    timeout_s = _spawn_wait_s(parallel)
    away = dict(enumerate(processes, 1))
    deadline = time.monotonic() + timeout_s
    while away:
        for rank in [r for r in away if store.check([f"tandem/joined/{r}"])]:
            del away[rank]
        dead = {r: p.exitcode for r, p in away.items() if p.exitcode is not None}
        late = away and time.monotonic() > deadline
        if dead or late:
            for process in processes:
                process.kill()
            if dead:
                exits = ", ".join(f"rank {r} exited with code {code}" for r, code in dead.items())
                raise WorkerError("; ".join([f"{exits} before joining the engine's ranks", *_sent_tracebacks(errors)]))
            raise WorkerError(
                f"rank {', '.join(map(str, away))} did not join the engine's ranks within {timeout_s:g} s"
            )
        if away:
            time.sleep(JOIN_POLL_S)


def _spawned_worker(rank, parallel, device, port, errors) -> None:
    """A spawned worker's process: join the group, then :func:`follow` until the driver stops it."""
    try:
        if device.type == "cuda":
            torch.cuda.set_device(rank_device(device, rank))
        store = _spawn_store(port, rank, parallel)
        dist.init_process_group(
            _backend(device), store=store, rank=rank, world_size=parallel.world_size, timeout=parallel.timeout
        )
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.world_size))
        follow(parallel, device)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


def follow_launcher(parallel: ParallelConfig, device: torch.device | str) -> None:
    """A rank that ``torchrun`` started and that drives no engine: join its engine's group (:func:`_join_launch`)
    and :func:`follow` that engine's driver."""
    _join_launch(parallel, torch.device(device))
    follow(parallel, device)


def launch_store() -> dist.Store:
    """torchrun's store, at ``MASTER_ADDR:MASTER_PORT``: its agent's where it hosts one, else rank 0's."""
    host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ["RANK"] == "0"
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=host, timeout=LAUNCH_STORE_TIMEOUT
    )


def _join_launch(parallel: ParallelConfig, device: torch.device) -> None:
    """Under ``torchrun``: join this rank's engine's process group, as its default group. Its ranks are every rank
    torchrun started, or, where it started several engines of ``parallel.world_size`` ranks each (tensor-parallel
    engine replicas, :mod:`tandem.engine.replicas`), this rank's engine's: engine ``RANK // world_size``, ranked
    ``RANK % world_size``, a group of its own over torchrun's store."""
    world, size, rank = int(os.environ["WORLD_SIZE"]), parallel.world_size, int(os.environ["RANK"])
    if world % size:
        raise ValueError(f"torchrun started {world} ranks, not a multiple of the layout's {size} ({parallel})")
    if world == size:
        dist.init_process_group(_backend(device), timeout=parallel.timeout)
        return
    store = dist.PrefixStore(f"tandem/engine{rank // size}/", launch_store())
    dist.init_process_group(_backend(device), store=store, rank=rank % size, world_size=size, timeout=parallel.timeout)


@dataclass
class _Replica:
    """A worker's part of one engine: its target shard, its cache and what runs the forwards (the target or a
    graph runner over it); its draft's part and cache (a draft in the target's layout), and the last forward's
    rows and hidden states, which the draft reads."""

    target: Any
    cache: KVCache | None = None
    layout: CacheLayout | None = None
    model: Any = None
    draft: Any = None
    draft_cache: KVCache | None = None
    last: tuple[RowSpans, torch.Tensor | None] | None = None


def follow(parallel: ParallelConfig, device: torch.device | str) -> None:
    """A worker rank's loop (the process group is up): load each engine's shard, mirror its cache, run each
    forward the driver describes (counting them in :func:`_progress`), until it sends None."""
    from tandem.models.linear import narrow_exact_weights
    from tandem.models.loading import load_draft, load_target

    rank = dist.get_rank()
    device = rank_device(torch.device(device), rank)
    progress = _progress()
    progress.set(str(rank), "0")
    control = _control_group()
    replicas: dict[int, _Replica] = {}
    while True:
        message = _broadcast(None, control, None)
        if message is None:
            break
        if isinstance(message, _Load):
            shard = parallel.shard(rank, message.model_type)
            target = load_target(message.path, dtype=message.dtype, device=device, shard=shard)
            if message.narrow:
                narrow_exact_weights(target)
            replicas[message.engine] = _Replica(target)
        elif isinstance(message, _LoadDraft):
            replica = replicas[message.engine]
            replica.draft = load_draft(message.source, replica.target, dtype=message.dtype, device=device)
            if message.narrow:
                narrow_exact_weights(replica.draft)
        elif isinstance(message, _Mirror):
            replica, layout = replicas[message.engine], message.layout
            table = BlockTable(
                layout.num_slots,
                layout.max_len,
                layout.block_size,
                layout.num_blocks,
                device,
                scratch_block=layout.scratch_block,
            )
            replica.cache = replica.target.new_cache(layout.num_slots, layout.max_len, table=table)
            replica.layout = layout
            replica.model = _model(replica)
        elif isinstance(message, _MirrorDraft):
            replica = replicas[message.engine]
            table = replica.cache.table
            replica.draft_cache = replica.draft.new_cache(table.num_slots, replica.cache.max_len, table=table)
            replica.model = _model(replica)  # the draft's steps too, as the driver's runner runs them
        elif isinstance(message, _Release):
            del replicas[message.engine]
        else:
            replica = replicas[message.engine]
            if isinstance(message, _Draft):
                _run_draft(message, replica, device)
            else:
                out = _run_forward(message, replica.model, replica.cache, device)
                replica.last = (message.spans, out.hidden)
            progress.add(str(rank), 1)
    dist.destroy_process_group()


def _model(replica: _Replica) -> Any:
    """What runs ``replica``'s forwards: its target, or in graph mode a graph runner over it and its draft (with its
    cache, once mirrored): each rank builds and runs its own graphs of the shapes the driver's runner runs."""
    from tandem.engine.graphs import GraphRunner

    layout = replica.layout
    if layout.widths is None:
        return replica.target
    return GraphRunner(
        replica.target,
        replica.cache,
        replica.draft,
        replica.draft_cache,
        widths=layout.widths,
        capture_sizes=layout.capture_sizes,
    )


def _mirror_state(message: _Forward | _Draft, cache: KVCache) -> None:
    """Set ``cache``'s lengths, and its block table's rows when they changed, to the driver's."""
    cache.lengths = list(message.lengths)
    if message.table is not None:
        for slot, (blocks, read_only) in enumerate(zip(*message.table)):
            cache.table.set_blocks(slot, blocks, read_only)


def _receive_ids(num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[num_tokens]`` int64 that the driver broadcasts."""
    ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
    dist.broadcast(ids, src=0)
    return ids


def _hidden_rows(forward: RowSpans, draft: RowSpans) -> list[int]:
    """The indices, among the tokens of the ``forward`` just run, of the hidden states before each token of the
    ``draft``'s rows: a row's draft tokens start one past its forward's first, in the same slot (what
    ``tandem.engine.batching.draft_batch`` reads on the driver)."""
    offsets, row = forward.offsets(), {slot: b for b, slot in enumerate(forward.slots)}
    return [t for slot, n in zip(draft.slots, draft.lengths) for t in range(offsets[row[slot]], offsets[row[slot]] + n)]


@torch.inference_mode()
def _run_forward(message: _Forward, model, cache: KVCache, device: torch.device) -> TargetOutput:
    """Mirror the driver's cache state, receive the ids, run the forward (its collectives meet the driver's)."""
    _mirror_state(message, cache)
    input_ids = _receive_ids(sum(message.spans.lengths), device)
    logits_indices = None if message.num_logits is None else _receive_ids(message.num_logits, device)
    batch = ForwardBatch.build(input_ids, message.spans, logits_indices=logits_indices)
    return model.forward(batch, cache, return_hidden=message.return_hidden, return_aux=message.return_aux)


@torch.inference_mode()
def _run_draft(message: _Draft, replica: _Replica, device: torch.device) -> None:
    """Mirror the driver's draft cache state and run this rank's part of its proposal over the last forward's
    hidden states: the steps' ids and chosen tokens received, nothing read back (the driver chooses)."""
    _mirror_state(message, replica.draft_cache)
    batch = ForwardBatch.build(_receive_ids(sum(message.spans.lengths), device), message.spans)
    spans, hidden = replica.last
    hidden = hidden[int64_tensor(_hidden_rows(spans, message.spans), device)]
    step = replica.model.draft_step if message.graphs else replica.draft.step
    follow_chained(step, batch, hidden, replica.draft_cache, message.num_tokens, lambda n: _receive_ids(n, device))
