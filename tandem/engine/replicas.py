"""Engine replicas behind one front end: data parallelism for a dense target (Llama's ``data_parallel_size``).

Replica 0 is the driver's own engine; each other replica is a process running a whole engine of its own (its
copy of the target and draft, its scheduler, KV cache and grammar compiler), as vLLM runs an engine core per
data-parallel rank behind one API server. A replica may itself be tensor-parallel: its process is then the
driver of worker ranks of its own (:mod:`tandem.engine.workers`, its own process group on its own port), and
:func:`replica_devices` gives replica ``r`` the GPUs ``r * tp`` to ``r * tp + tp - 1``, so no two share one.

:class:`ReplicatedEngine` answers what ``tandem.LLM`` and the server ask of an :class:`~tandem.engine.Engine`: a
new request goes to the replica with the fewest unfinished requests (checked here first, so a bad request fails
at once as on one engine); a step steps the driver's replica while the others step on their own, and returns
every replica's stream deltas that have arrived. The replicas share nothing, so a request decodes exactly as
one engine would decode it.

Messages go over ``multiprocessing`` pipes (requests in; deltas, finished outputs and KV counters out); the
replica processes are built by a picklable ``build()`` that returns an object with an ``engine`` and a
``close()`` (``tandem.LLM`` passes its own class with every setting it was given, so each replica's
:class:`~tandem.engine.EngineConfig` is replica 0's). :class:`ReplicaProcesses` starts them all before
``tandem.LLM`` builds replica 0, and they build side by side, so start-up takes about the slowest replica's
time, not the sum. A replica that dies, or fails to start, ends the front end with
:class:`~tandem.engine.workers.WorkerError` naming it, and the other replicas are stopped.

Under ``torchrun`` (one node or several) the launcher starts every rank: replica ``r`` is ranks ``r * tp`` to
``r * tp + tp - 1``, its first the replica's driver, the others its workers in a process group of their own
(``tandem.engine.workers``). Rank 0 runs the command and the front end; it listens on a ``multiprocessing``
connection (authenticated, its address and key published in torchrun's store) and each other replica's driver
connects to it and runs :func:`serve_replicas`: it builds each replica engine rank 0 sends it (the same picklable
``build()``, on its own device) and runs it over that connection as a spawned replica runs over its pipe.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import secrets
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.decoding.params import SamplingParams
from tandem.engine.engine import Engine, EngineConfig
from tandem.engine.kv_blocks import KVStats
from tandem.engine.output import RequestOutput, StreamDelta
from tandem.engine.workers import WorkerError, devices_here, launch_store, launched, rank_device

IDLE_WAIT_S = 0.05  # how long a step with nothing to run locally waits for the other replicas' messages
STOP_WAIT_S = 10.0  # how long a replica may take to close its engine (and its ranks) and exit before it is ended
READY_TIMEOUT_S = 600.0  # how long a replica may take to build its engine (vLLM's engine-ready wait is as long)


def replica_devices(replicas: int, tensor_parallel_size: int, device: torch.device) -> list[torch.device]:
    """The device of each replica's rank 0 (its driver), ``replicas`` engines of ``tensor_parallel_size`` ranks
    each; raise ValueError naming the setting this machine or launch cannot run. On CUDA replica ``r`` takes
    the GPUs ``first + r * tp`` to ``first + r * tp + tp - 1`` (``first``: ``device``'s index, 0 when it has
    none). On the CPU every replica runs on ``device`` and the replicas' ranks share the cores (slower, not
    wrong): the replicas are held to the core count here, each one's ranks by
    :meth:`~tandem.engine.workers.ParallelConfig.check`."""
    tp = tensor_parallel_size
    if replicas < 1 or tp < 1:
        raise ValueError(f"data_parallel_size {replicas} and tensor_parallel_size {tp} must be at least 1")
    if launched():  # replica r: ranks r * tp .. r * tp + tp - 1, each on its own device (:func:`serve_replicas`)
        if int(os.environ["WORLD_SIZE"]) != replicas * tp:
            raise ValueError(
                f"data_parallel_size {replicas} x tensor_parallel_size {tp} = {replicas * tp} ranks for a Llama "
                f"model's engine replicas, but torchrun started {os.environ['WORLD_SIZE']}"
            )
        return [rank_device(device, 0), *[device] * (replicas - 1)]  # the others: their own rank's
    available, what = devices_here(device)
    if device.type != "cuda":
        if replicas > available:
            raise ValueError(f"data_parallel_size {replicas} engine replicas but this machine has {available} {what}")
        return [device] * replicas
    first = device.index or 0
    if first + replicas * tp > available:
        raise ValueError(
            f"data_parallel_size {replicas} x tensor_parallel_size {tp} = {replicas * tp} GPUs from cuda:{first}, "
            f"but this machine has {available} GPUs"
        )
    return [torch.device("cuda", first + r * tp) for r in range(replicas)]


@dataclasses.dataclass
class _Remote:
    """The driver's view of one replica process."""

    index: int
    process: Any
    conn: Connection
    unfinished: set[str] = dataclasses.field(default_factory=set)
    waiting: set[str] = dataclasses.field(default_factory=set)
    stats: KVStats | None = None
    config: EngineConfig | None = None  # its engine's, once built (None: still starting)

    @property
    def started(self) -> bool:
        return self.config is not None


class ReplicaProcesses:
    """Replicas 1, 2, ... (one per ``builds`` entry), each a process started at construction that builds its
    engine while the caller builds replica 0's; :meth:`wait_ready` waits for them. Owns their pipes: a message
    that cannot be sent or received, or a replica's failure, closes them all and raises
    :class:`~tandem.engine.workers.WorkerError` naming the replica."""

    def __init__(self, builds: list[Callable[[], Any]]) -> None:
        self.closed = False
        self.remotes: list[_Remote] = []
        if launched():  # the other replicas' first ranks: each builds what it is sent (serve_replicas)
            for index, ((rank, conn), build) in enumerate(zip(_launched_replicas(len(builds)), builds), 1):
                self.remotes.append(_Remote(index, _LaunchedReplica(rank, conn), conn))
                self.send(self.remotes[-1], ("build", build))
            return
        context = mp.get_context("spawn")
        for index, build in enumerate(builds, 1):
            ours, theirs = context.Pipe()
            process = context.Process(target=_replica_main, args=(theirs, build), name=f"tandem-replica{index}")
            process.start()
            theirs.close()  # the child's end lives in the child: its exit then ends our reads (EOFError)
            self.remotes.append(_Remote(index, process, ours))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until every replica's engine is built (each one's config is then set), in whatever order they
        finish; the first that fails or exits raises, naming it, with the others stopped, as do replicas still
        building after `timeout_s` (a hung build ends start-up, not waits forever)."""
        starting = {remote.conn: remote for remote in self.remotes if not remote.started}
        deadline = time.monotonic() + timeout_s
        while starting:
            ready = wait(list(starting), timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                self.close()
                names = ", ".join(str(remote.index) for remote in starting.values())
                raise WorkerError(f"replica {names} did not start within {timeout_s:g} s (still building; stopped)")
            for conn in ready:
                remote = starting.pop(conn)
                _, remote.config = self.recv(remote)  # before "ready" a replica sends nothing else ("failed": raised)

    def send(self, remote: _Remote, message: tuple) -> None:
        try:
            remote.conn.send(message)
        except OSError as error:
            raise self._lost(remote) from error

    def recv(self, remote: _Remote) -> tuple:
        try:
            message = remote.conn.recv()
        except (EOFError, OSError) as error:
            raise self._lost(remote) from error
        if message[0] == "failed":  # it exits by itself once it reported (closing what it built)
            remote.process.join(timeout=STOP_WAIT_S)
            self.close()
            raise WorkerError(f"replica {remote.index} failed{'' if remote.started else ' to start'}:\n{message[1]}")
        return message

    def close(self) -> None:
        """Stop the replica processes: a running one is told to stop (it closes its engine and its ranks); one still
        building, or that does not stop within STOP_WAIT_S, is terminated (its own ranks end with it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for remote in self.remotes:
            if remote.started and remote.process.is_alive():
                try:
                    remote.conn.send(("stop",))
                except OSError:
                    pass
            else:
                remote.process.terminate()
        for remote in self.remotes:
            remote.process.join(timeout=STOP_WAIT_S)
            if remote.process.is_alive():
                remote.process.terminate()
                remote.process.join(timeout=1)

    def _lost(self, remote: _Remote) -> WorkerError:
        remote.process.join(timeout=1)
        self.close()
        when = "" if remote.started else " before its engine started"
        if isinstance(remote.process, _LaunchedReplica):
            rank = remote.process.rank
            return WorkerError(f"replica {remote.index} (torchrun's rank {rank}) closed its connection{when}")
        return WorkerError(f"replica {remote.index} exited with code {remote.process.exitcode}{when}")


class _LaunchedReplica:
    """What :class:`ReplicaProcesses` asks of a replica's process, for a rank that ``torchrun`` started (the launcher
    owns the process): alive until it reports its engine closed, or its connection ends; terminating it closes the
    connection, which ends the rank's :func:`serve_replicas` (a later engine of this process then fails naming it)."""

    exitcode = None

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank, self.conn, self.stopped = rank, conn, False

    def is_alive(self) -> bool:
        return not (self.stopped or self.conn.closed)

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the rank to report its engine closed (its steps' messages before
        that are dropped: the engine is stopping)."""
        deadline = time.monotonic() + timeout
        while self.is_alive() and self.conn.poll(max(deadline - time.monotonic(), 0.0)):
            try:
                self.stopped = self.conn.recv()[0] == "stopped"
            except (EOFError, OSError):
                self.conn.close()

    def terminate(self) -> None:
        self.conn.close()


# ------------------------------------------------------------------ under torchrun
STORE_PREFIX = "tandem/replicas/"
_LAUNCHED: list[tuple[int, Connection]] = []  # rank 0: the other replicas' first ranks and connections


def _launched_replicas(count: int) -> list[tuple[int, Connection]]:
    """Rank 0's connections to the ``count`` other replicas' first ranks, with their ranks, in rank order: accepted
    the first time (the address and key published in torchrun's store), kept for the process's later engines."""
    closed = [rank for rank, conn in _LAUNCHED if conn.closed]
    if closed:
        raise WorkerError(f"torchrun's rank {closed[0]} left when an earlier engine replica failed")
    if len(_LAUNCHED) != count:
        if _LAUNCHED:
            raise WorkerError(f"{count} engine replicas besides rank 0's, but {len(_LAUNCHED)} are connected")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet: the route's own address
            probe.connect((os.environ["MASTER_ADDR"], 9))
            host = probe.getsockname()[0]
        key = secrets.token_bytes(32)
        with Listener(("0.0.0.0", 0), authkey=key) as listener:
            store = dist.PrefixStore(STORE_PREFIX, launch_store())
            store.set("key", key.hex())
            store.set("address", f"{host}:{listener.address[1]}")
            conns = {}
            while len(conns) < count:
                conn = listener.accept()
                conns[conn.recv()] = conn  # its rank
        _LAUNCHED.extend(sorted(conns.items()))
    return list(_LAUNCHED)


def serve_replicas(device: torch.device | str) -> None:
    """A replica's driver that ``torchrun`` started (a Llama model's ``data_parallel_size``; not rank 0): connect to
    rank 0, then build each replica engine it sends (on this rank's device, of ``device``'s type) and run it until
    rank 0 stops it, as a spawned replica runs; return when rank 0 closes the connection."""
    store = dist.PrefixStore(STORE_PREFIX, launch_store())
    host, port = store.get("address").decode().rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(store.get("key").decode()))
    rank = int(os.environ["RANK"])
    conn.send(rank)
    own = str(rank_device(torch.device(device), rank))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "build":
            build = message[1]
            _replica_main(conn, functools.partial(build.func, *build.args, **build.keywords | {"device": own}))
            try:
                conn.send(("stopped",))
            except OSError:  # rank 0 closed it (the engine failed): nothing more to serve
                return


class ReplicatedEngine:
    """Replica 0 (``local``, this process's engine) and the ``replicas`` processes, behind the
    :class:`~tandem.engine.Engine` methods the front ends call; waits for the replicas to be ready (closing them
    if one fails to start)."""

    def __init__(self, local: Engine, replicas: ReplicaProcesses) -> None:
        self.local, self.replicas = local, replicas
        self.remotes = replicas.remotes
        replicas.wait_ready()
        self._ids = itertools.count()
        self.assigned = [0] * self.num_replicas  # requests each replica was given
        self._owner: dict[str, _Remote] = {}
        self._finished: dict[str, RequestOutput] = {}
        self._deltas: list[StreamDelta] = []

    # ---------------------------------------------------------------- what the front ends read
    @property
    def config(self):
        return self.local.config

    @property
    def k(self) -> int:
        return self.local.k

    @property
    def num_replicas(self) -> int:
        return 1 + len(self.remotes)

    @property
    def configs(self) -> list[EngineConfig]:
        """Every replica's engine settings, replica 0's first."""
        return [self.local.config, *(remote.config for remote in self.remotes)]

    def compile_grammar(self, params: SamplingParams):
        return self.local.compile_grammar(params)

    def waiting_ids(self) -> set[str]:
        return self.local.waiting_ids().union(*(r.waiting for r in self.remotes))

    def kv_stats(self) -> KVStats:
        """Every replica's counters summed (the others' as of their last step)."""
        stats = [self.local.kv_stats(), *(r.stats for r in self.remotes if r.stats is not None)]
        return KVStats(*(sum(values) for values in zip(*(dataclasses.astuple(s) for s in stats))))

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request on the least loaded replica; raises as :meth:`Engine.add_request` does."""
        request_id = request_id or f"req-dp{next(self._ids)}"
        loads = [len(self.local.scheduler.waiting) + len(self.local.scheduler.running)]
        loads += [len(r.unfinished) for r in self.remotes]
        replica = loads.index(min(loads))
        if replica == 0:
            request_id = self.local.add_request(prompt, params, request_id)
            self.assigned[0] += 1
            return request_id
        self.local.check_request(prompt, params)  # a bad request fails here, as on one engine
        schema = params.json_schema
        if isinstance(schema, type):  # a pydantic model class: its schema travels, not the class
            params = dataclasses.replace(params, json_schema=schema.model_json_schema())
        remote = self.remotes[replica - 1]
        self.replicas.send(remote, ("add", list(prompt), params, request_id))
        remote.unfinished.add(request_id)
        self._owner[request_id] = remote
        self.assigned[replica] += 1
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request; its output (finish reason "abort") is ready for :meth:`pop_finished` on return."""
        remote = self._owner.get(request_id)
        if remote is None:
            self.local.abort(request_id)
            return
        if request_id in remote.unfinished:
            self.replicas.send(remote, ("abort", request_id))
            self._receive(remote, until=request_id)

    def has_unfinished(self) -> bool:
        return self.local.has_unfinished() or any(r.unfinished for r in self.remotes) or bool(self._deltas)

    def pop_finished(self, request_id: str) -> RequestOutput | None:
        if request_id not in self._owner:
            return self.local.pop_finished(request_id)
        output = self._finished.pop(request_id, None)
        if output is not None:
            del self._owner[request_id]
        return output

    def step(self) -> list[StreamDelta]:
        """The driver's replica's step, and what the other replicas sent since the last one."""
        deltas = self.local.step() if self.local.has_unfinished() else []
        busy = [r for r in self.remotes if r.unfinished]
        if busy:
            for conn in wait([r.conn for r in busy], timeout=0 if deltas else IDLE_WAIT_S):
                remote = next(r for r in busy if r.conn is conn)
                while remote.conn.poll():
                    self._handle(remote, self.replicas.recv(remote))
        deltas += self._deltas
        self._deltas = []
        return deltas

    def close(self) -> None:
        """Stop the replica processes. Idempotent."""
        self.replicas.close()

    # ---------------------------------------------------------------- messages
    def _receive(self, remote: _Remote, until: str) -> None:
        """Handle ``remote``'s messages until one names ``until`` (an aborted request's id)."""
        while True:
            message = self.replicas.recv(remote)
            self._handle(remote, message)
            if until in message[2] or until not in remote.unfinished:
                return

    def _handle(self, remote: _Remote, message: tuple) -> None:
        """A replica's step: its deltas, the outputs of the requests that finished, its waiting ids and counters."""
        _, deltas, finished, remote.waiting, remote.stats = message
        self._deltas += deltas
        self._finished.update(finished)
        remote.unfinished -= finished.keys()


def _replica_main(conn: Connection, build: Callable[[], Any]) -> None:
    """A replica process: build its engine, then apply requests and step until told to stop (then close what it
    built: a tensor-parallel replica's worker ranks stop with it). Terminated (SIGTERM) it exits through
    SystemExit, so multiprocessing still stops the ranks it started."""
    signal.signal(signal.SIGTERM, _exit)
    built = None
    try:
        built = build()
        engine = built.engine
        conn.send(("ready", engine.config))
        while True:
            finished: dict[str, RequestOutput] = {}
            while conn.poll(0 if engine.has_unfinished() or finished else None):  # blocks only when idle
                command = conn.recv()
                if command[0] == "stop":
                    return
                if command[0] == "add":
                    engine.add_request(command[1], command[2], command[3])
                else:  # abort: the output goes back at once (the driver waits for it), unless it went already
                    engine.abort(command[1])
                    output = engine.pop_finished(command[1])
                    if output is not None:
                        finished[command[1]] = output
            deltas = engine.step() if engine.has_unfinished() else []
            for delta in deltas:
                if delta.finish_reason is not None:
                    finished[delta.request_id] = engine.pop_finished(delta.request_id)
            if deltas or finished:
                conn.send(("step", deltas, finished, engine.waiting_ids(), engine.kv_stats()))
    except Exception:
        conn.send(("failed", traceback.format_exc()))
    finally:
        if built is not None:
            built.close()


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
