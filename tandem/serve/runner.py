"""The engine thread: the only thread that touches the engine, fed by the asyncio HTTP side.

HTTP handlers call `EngineRunner.submit` (on the event loop) and get a `Generation`: one engine
request per choice. Commands (start, abort, stop) travel to the engine thread through a
thread-safe queue and are applied between steps. The thread

1. applies pending commands (blocking on the queue only while it has nothing to run),
2. adds to the engine the submissions whose grammar finished compiling — a grammar error or a
   prompt that does not fit rejects the whole submission before anything runs, so a bad request
   never reaches the batch,
3. runs one `Engine.step()` (which gives waiting requests free rows) and settles `admitted()` of
   the generations that now have a row (with n > 1 choices and few rows, the others follow), and
4. hands each generation its deltas and finished outputs with `loop.call_soon_threadsafe`.

A generation whose client went away is aborted by its handler; the abort frees the engine rows
at the next pass through (1).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tandem.decoding.params import SamplingParams
from tandem.engine import Engine
from tandem.engine.output import RequestOutput, StreamDelta
from tandem.grammars.compiler import CompileJob
from tandem.serve.metrics import Metrics

Job = tuple[list[int], SamplingParams]  # one engine request: prompt ids and how to sample


@dataclass
class Event:
    """What one choice of a generation gained: new text, or its final output (exactly one is set)."""

    index: int
    delta: StreamDelta | None = None
    output: RequestOutput | None = None


class EngineFailure(RuntimeError):
    """The engine raised while stepping; every generation in flight fails with it."""


class Generation:
    """The engine requests of one HTTP request (choice i = jobs[i]), seen from the event loop.

    `admitted()` waits until a job has its row in the engine's batch or raises why none can;
    `events()` then yields each choice's deltas and its final output; `abort()` drops the rest.
    """

    def __init__(self, runner: EngineRunner, jobs: list[Job]) -> None:
        self.jobs = jobs
        self._runner = runner
        self._loop = asyncio.get_running_loop()
        self._admitted: asyncio.Future[None] = self._loop.create_future()
        self._events: asyncio.Queue[Event | Exception] = asyncio.Queue()
        self._remaining = len(jobs)  # choices without a final output yet

    @property
    def finished(self) -> bool:
        return self._remaining == 0

    async def admitted(self) -> None:
        """Wait until a job runs (has its engine row); raises the admission error (grammar, prompt length)."""
        await self._admitted

    async def events(self) -> AsyncIterator[Event]:
        """Deltas and final outputs in engine order, until every choice has finished."""
        while self._remaining:
            event = await self._events.get()
            if isinstance(event, Exception):
                self._remaining = 0
                raise event
            if event.output is not None:
                self._remaining -= 1
            yield event

    def abort(self) -> None:
        """Drop every unfinished choice; the engine frees their rows before its next step."""
        if self._remaining:
            self._runner.abort(self)

    # ---- called on the event loop by the engine thread (through call_soon_threadsafe)
    def _resolve(self, error: Exception | None, cancelled: bool) -> None:
        if self._admitted.done():
            return
        if error is not None or cancelled:
            self._remaining = 0  # nothing reached the engine
        if cancelled:
            self._admitted.cancel()
        elif error is not None:
            self._admitted.set_exception(error)
        else:
            self._admitted.set_result(None)

    def _put(self, events: list[Event | Exception]) -> None:
        for event in events:
            self._events.put_nowait(event)

    def deliver(self, events: list[Event | Exception]) -> None:
        """Thread-safe: queue events for `events()`."""
        self._loop.call_soon_threadsafe(self._put, events)

    def resolve(self, error: Exception | None = None, *, cancelled: bool = False) -> None:
        """Thread-safe: settle `admitted()`: admitted, rejected with `error`, or cancelled (aborted first)."""
        self._loop.call_soon_threadsafe(self._resolve, error, cancelled)


@dataclass
class _Pending:
    """A submission whose grammar is still compiling."""

    generation: Generation
    grammar: CompileJob | None


class EngineRunner:
    """Owns the engine and its thread; `submit` and `abort` are safe to call from the event loop."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self._commands: queue.Queue[tuple[str, Generation | None]] = queue.Queue()
        self._pending: list[_Pending] = []
        self._live: dict[str, tuple[Generation, int]] = {}  # engine request id -> (generation, choice)
        self._waiting: dict[Generation, list[str]] = {}  # in the engine, every request still without a row
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread after its current step; unfinished requests are dropped."""
        self._commands.put(("stop", None))
        self._thread.join(timeout_s)

    def submit(self, jobs: list[Job]) -> Generation:
        """Queue engine requests for one HTTP request (call on the event loop); see `Generation`."""
        generation = Generation(self, jobs)
        self._commands.put(("start", generation))
        return generation

    def abort(self, generation: Generation) -> None:
        """Ask the engine thread to drop a generation's unfinished requests."""
        self._commands.put(("abort", generation))

    # ------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while self._apply_commands(block=not (self.engine.has_unfinished() or self._pending)):
            self._admit_compiled()
            if self.engine.has_unfinished():
                self._step()
            elif self._pending:
                time.sleep(0.001)  # only grammars compiling: leave the CPU to their workers
            self.metrics.set_running(len(self._live) + sum(len(p.generation.jobs) for p in self._pending))

    def _step(self) -> None:
        """One engine step, its deltas delivered; an engine exception fails every live generation."""
        start = time.perf_counter()
        try:
            deltas = self.engine.step()
        except Exception as error:  # a bug in a model or backend: fail what runs, keep serving
            self._fail_all(EngineFailure(f"engine step failed: {type(error).__name__}: {error}"))
            return
        self._resolve_running()
        self._deliver(deltas)
        self.metrics.record_step(time.perf_counter() - start)
        self.metrics.record_kv(self.engine.kv_stats())

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; False once told to stop."""
        while True:
            try:
                command, generation = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command == "stop":
                return False
            if command == "start":
                self._start(generation)
            else:
                self._abort(generation)

    def _start(self, generation: Generation) -> None:
        """Begin compiling the generation's grammar (shared by its jobs); a malformed spec rejects it now."""
        try:
            grammar = self.engine.compile_grammar(generation.jobs[0][1])
        except Exception as error:
            generation.resolve(error)
            return
        self._pending.append(_Pending(generation, grammar))

    def _admit_compiled(self) -> None:
        """Add every job of the submissions whose grammar is ready; all or none per submission."""
        for pending in [p for p in self._pending if p.grammar is None or p.grammar.done()]:
            self._pending.remove(pending)
            generation, added = pending.generation, []
            try:
                if pending.grammar is not None:
                    pending.grammar.result()  # raises the grammar's error
                for index, (prompt, params) in enumerate(generation.jobs):
                    added.append((self.engine.add_request(prompt, params), index))
            except Exception as error:
                for request_id, _ in added:
                    self.engine.abort(request_id)
                    self.engine.pop_finished(request_id)
                generation.resolve(error)
                continue
            self._live.update({request_id: (generation, index) for request_id, index in added})
            self._waiting[generation] = [request_id for request_id, _ in added]

    def _resolve_running(self) -> None:
        """Settle `admitted()` of the generations one of whose requests left the engine's waiting queue."""
        if not self._waiting:
            return
        waiting = self.engine.waiting_ids()
        for generation, request_ids in list(self._waiting.items()):
            if not waiting.issuperset(request_ids):
                del self._waiting[generation]
                generation.resolve()

    def _abort(self, generation: Generation) -> None:
        """Drop the generation's unfinished requests; their outputs (finish reason "abort") are delivered."""
        in_engine_waiting = self._waiting.pop(generation, None)
        if in_engine_waiting or any(p.generation is generation for p in self._pending):
            self._pending = [p for p in self._pending if p.generation is not generation]
            generation.resolve(None, cancelled=True)
        events: list[Event | Exception] = []
        for request_id in [rid for rid, (owner, _) in self._live.items() if owner is generation]:
            self.engine.abort(request_id)
            output = self.engine.pop_finished(request_id)
            self.metrics.record_finished(output)
            events.append(Event(self._live.pop(request_id)[1], output=output))
        if events:
            generation.deliver(events)

    def _deliver(self, deltas: list[StreamDelta]) -> None:
        """Hand out this step's deltas, then the outputs of requests that finished (one call per generation)."""
        events: dict[Generation, list[Event | Exception]] = defaultdict(list)
        for delta in deltas:
            if delta.request_id in self._live and delta.has_content:
                generation, index = self._live[delta.request_id]
                events[generation].append(Event(index, delta=delta))
        for request_id in list(self._live):
            output = self.engine.pop_finished(request_id)
            if output is not None:
                generation, index = self._live.pop(request_id)
                self.metrics.record_finished(output)
                events[generation].append(Event(index, output=output))
        for generation, batch in events.items():
            generation.deliver(batch)

    def _fail_all(self, error: Exception) -> None:
        for generation in {generation for generation, _ in self._live.values()}:
            if self._waiting.pop(generation, None):
                generation.resolve(error)
            else:
                generation.deliver([error])
        for request_id in list(self._live):
            self.engine.abort(request_id)
            self.engine.pop_finished(request_id)
        self._live.clear()
