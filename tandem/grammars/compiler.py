"""GrammarCompiler: cached, time-limited compilation off the decoding loop.

`submit` returns at once with a `CompileJob` the engine can poll; compilation runs on a small
worker pool, so one slow schema holds one worker and never the step loop or other requests.
Results (and deterministic failures) are cached by (tokenizer fingerprint, backend, spec).
A job past its time limit reports GrammarCompileTimeout; Python cannot kill the worker thread,
so it finishes in the background and its result still lands in the cache.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError

from tandem.grammars.backends import BACKENDS, CompiledGrammar
from tandem.grammars.errors import GrammarCompileError, GrammarCompileTimeout, GrammarRefused
from tandem.grammars.lowering import lower_source
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.support import native_formats, unhonoured
from tandem.grammars.tokenizer import GrammarTokenizer

# backend="auto" takes the first of AUTO_ORDER that honours the spec. Measured with
# `tandem eval-schemas MASKBENCH_DIR` (the shipped tokenizer): llguidance compiles the most schemas
# soundly and compiles much faster, and with its forced runs kept (backends/llguidance.py) its typical
# mask is no slower than xgrammar's; xgrammar honours no keyword that llguidance does not, rejects
# valid instances where llguidance does not (support.NARROWED), and its masks allow every
# tokenization of a key or constant where llguidance's keep the tokenizer's own:
# on the demo models those other splits lead answers astray (tests/engine/test_llm.py and
# test_json_whitespace.py ran to max_tokens when auto preferred xgrammar). outlines-core honours the
# fewest keywords and its DFA compilation can run for minutes, so it comes last.
AUTO_ORDER = ("llguidance", "xgrammar", "outlines")


def compile_grammar(spec: GrammarSpec, tokenizer: GrammarTokenizer, backend: str = "auto") -> CompiledGrammar:
    """Compile `spec` now, on this thread.

    Raises GrammarRefused (strict spec, backend would ignore keywords: the error lists them),
    GrammarCompileError (backend failed, or cannot take this spec kind), ValueError (unknown backend).
    With backend="auto", the first of AUTO_ORDER that honours and compiles the spec wins; if none
    does, the error lists every backend's reason.
    """
    if backend == "auto":
        return _compile_auto(spec, tokenizer)
    if backend not in BACKENDS:
        raise ValueError(f"unknown grammar backend {backend!r}; choose from {sorted(BACKENDS)} or 'auto'")
    module = BACKENDS[backend]
    if spec.kind not in module.KINDS:
        raise GrammarCompileError(
            f"backend {backend!r} does not compile {spec.kind} grammars (it takes {sorted(module.KINDS)})"
        )
    target = lowered(spec, backend)
    if spec.strict and (missing := unhonoured(target, backend)):
        raise GrammarRefused(backend, missing)
    start = time.perf_counter()
    try:
        new_matcher = module.compile(target, tokenizer)
    except Exception as e:  # each library raises its own types; normalise to one error
        raise GrammarCompileError(f"{backend}: {str(e).strip() or type(e).__name__}") from e
    return CompiledGrammar(spec, backend, new_matcher, time.perf_counter() - start)


def lowered(spec: GrammarSpec, backend: str) -> GrammarSpec:
    """The spec `backend` compiles and the support check reads: a JSON schema in its 2020-12 form
    (`normalize.py`) with `lowering.py`'s exact rewrites (formats the backend lacks as patterns);
    other kinds as they are. Raises GrammarRefused for a `$ref` that leaves the schema (no backend
    can follow it, strict or not)."""
    if spec.kind != "json_schema":
        return spec
    source, problems = lower_source(spec.source, native_formats(backend))
    if problems:
        raise GrammarRefused(backend, list(problems))
    return dataclasses.replace(spec, source=source)


def _compile_auto(spec: GrammarSpec, tokenizer: GrammarTokenizer) -> CompiledGrammar:
    reasons: list[str] = []
    refused: list[GrammarRefused] = []
    for backend in AUTO_ORDER:  # first choice: a backend that honours the spec
        try:
            return dataclasses.replace(
                compile_grammar(dataclasses.replace(spec, strict=True), tokenizer, backend), spec=spec
            )
        except GrammarRefused as e:
            refused.append(e)
            reasons.append(str(e))
        except GrammarCompileError as e:
            reasons.append(str(e))
    if not spec.strict:  # a non-strict spec then takes an approximation
        for refusal in refused:
            try:
                return compile_grammar(spec, tokenizer, refusal.backend)
            except GrammarCompileError as e:
                reasons.append(str(e))
    elif len(refused) == len(AUTO_ORDER):
        raise GrammarRefused("auto", sorted({item for e in refused for item in e.unhonoured}))
    raise GrammarCompileError("no backend can take this spec: " + "; ".join(reasons))


class CompileJob:
    """A compilation in flight. `done()` polls; `result()` blocks up to the time limit.

    The limit counts from when a worker starts the job, not from `submit`: waiting in the queue
    behind other requests' schemas does not use up this schema's time.
    """

    def __init__(self, spec: GrammarSpec, tokenizer: GrammarTokenizer, backend: str, timeout_s: float, unblock):
        self.args = (spec, tokenizer, backend)
        self.timeout_s = timeout_s
        self.future: Future = Future()
        self._unblock = unblock  # the compiler's check for a pool held by timed-out jobs
        self._started = threading.Event()
        self._claim = threading.Lock()
        self._start_time = 0.0

    def run(self) -> None:
        """Compile on the calling worker thread; a job already run elsewhere is skipped."""
        if not self._claim.acquire(blocking=False):
            return
        self._start_time = time.monotonic()
        self._started.set()
        spec, tokenizer, backend = self.args
        try:
            self.future.set_result(compile_grammar(spec, tokenizer, backend))
        except BaseException as e:
            self.future.set_exception(e)

    def timed_out(self) -> bool:
        """Started, unfinished, and past its time limit; never blocks."""
        return (
            self._started.is_set() and not self.future.done() and time.monotonic() >= self._start_time + self.timeout_s
        )

    def done(self) -> bool:
        """True once the result, an error, or the time limit is reached; never blocks."""
        if not self._started.is_set():
            self._unblock()
        return self.future.done() or self.timed_out()

    def result(self) -> CompiledGrammar:
        """The compiled grammar; raises its GrammarError, or GrammarCompileTimeout at the limit."""
        while not self._started.wait(0.05):
            self._unblock()
        remaining = self._start_time + self.timeout_s - time.monotonic()
        try:
            return self.future.result(timeout=max(remaining, 0.0))
        except TimeoutError:
            raise GrammarCompileTimeout(f"grammar compilation exceeded its {self.timeout_s:g} s time limit") from None


class GrammarCompiler:
    """A compile cache plus a worker pool with a per-job time limit (seconds).

    Python cannot stop a thread, so a timed-out compilation keeps its worker until it ends. When
    every worker is held that way, new jobs go to a fresh pool: stuck schemas never block others.
    """

    def __init__(self, *, max_workers: int = 2, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self._pool = self._new_pool()
        self._cache: dict[tuple[str, str, GrammarSpec], CompileJob] = {}
        self._pool_jobs: list[CompileJob] = []  # jobs sent to the current pool and not yet finished
        self._lock = threading.Lock()

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="grammar-compile")

    def submit(self, spec: GrammarSpec, tokenizer: GrammarTokenizer, backend: str = "auto") -> CompileJob:
        """Start (or reuse) the compilation of `spec`; returns immediately."""
        key = (tokenizer.fingerprint, backend, spec)
        with self._lock:
            job = self._cache.get(key)
            if job is None:
                job = self._cache[key] = CompileJob(spec, tokenizer, backend, self.timeout_s, self._unblock)
                self._pool_jobs.append(job)
                self._pool.submit(job.run)
        self._unblock()
        return job

    def _unblock(self) -> None:
        """If timed-out jobs hold every worker, move the queued jobs to a fresh pool."""
        with self._lock:
            self._pool_jobs = [j for j in self._pool_jobs if not j.future.done()]
            if sum(j.timed_out() for j in self._pool_jobs) < self.max_workers:
                return
            queued = [j for j in self._pool_jobs if not j.timed_out()]
            self._pool.shutdown(wait=False)  # its stuck threads finish in the background
            self._pool, self._pool_jobs = self._new_pool(), queued
            for job in queued:
                self._pool.submit(job.run)  # a job the old pool started meanwhile is skipped

    def compile(self, spec: GrammarSpec, tokenizer: GrammarTokenizer, backend: str = "auto") -> CompiledGrammar:
        """`submit(...).result()`: block until compiled, failed or timed out."""
        return self.submit(spec, tokenizer, backend).result()

    def shutdown(self) -> None:
        """Stop accepting jobs; running compilations are not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["AUTO_ORDER", "CompileJob", "GrammarCompiler", "compile_grammar", "lowered"]
