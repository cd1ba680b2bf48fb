"""A worker or replica that dies or hangs ends the engine with an error naming it, within a bounded time.

Apart from tests/engine/test_parallel.py, whose module fixtures keep two-process LLMs running: these tests start and
break their own ranks, and a process runs one layout of ranks at a time, so they must not meet a running one.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.workers import ParallelConfig, WorkerError
from tandem.llm import resolve_model
from tests.engine.test_parallel import LAYOUTS, PROMPTS, build, torchrun

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two CPU cores")


def test_a_killed_worker_ends_the_engine_with_its_rank():
    llm = build("demo-llama", tensor_parallel_size=2)
    worker = llm.workers.processes[0]
    stream = llm.stream(llm.chat_prompt([{"role": "user", "content": PROMPTS[0]}]), SamplingParams(max_tokens=200))
    next(stream)
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 exited with code -9"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 30
    llm.close()


def test_a_worker_killed_in_an_mtp_draft_forward_ends_the_engine_with_its_rank():
    """The MTP draft runs on both ranks: a worker that dies as the driver's draft step begins leaves that step's
    collectives unmet, and the error names the rank."""
    llm = build("demo-deepseek", **LAYOUTS["demo-deepseek"][1])
    worker, step = llm.workers.processes[0], llm.draft.step

    def kill_then_step(*args):
        os.kill(worker.pid, signal.SIGKILL)
        return step(*args)

    llm.draft.step = kill_then_step
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 exited with code -9") as failure:
        llm.generate(llm.chat_prompt([{"role": "user", "content": PROMPTS[0]}]), SamplingParams(max_tokens=16))
    assert time.monotonic() - start < 30
    assert "kill_then_step" in [frame.name for frame in traceback.extract_tb(failure.value.__cause__.__traceback__)]
    llm.close()


def test_a_replica_that_dies_ends_the_front_end_with_its_name():
    llm = LLM("demo-llama", "eagle3", max_num_seqs=1, max_model_len=512, data_parallel_size=2)
    engine = llm.engine
    prompt = llm.chat_prompt([{"role": "user", "content": PROMPTS[0]}])
    for _ in range(2):  # one per replica
        engine.add_request(prompt, SamplingParams(max_tokens=200))
    os.kill(engine.remotes[0].process.pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="replica 1 exited with code -9"):
        while engine.has_unfinished():
            engine.step()
    llm.close()


def test_a_worker_that_hangs_is_named_within_the_timeout():
    """A stopped worker never answers: the next collective waits out `timeout_s` and the error names the rank. (The
    timeout is also every collective's before the stop: 10 s leaves a loaded machine's first steps room.)"""
    from transformers import AutoTokenizer

    from tandem.engine import Engine, EngineConfig
    from tandem.engine.workers import Workers
    from tandem.models.loading import load_target, read_config

    path = resolve_model("demo-llama")
    parallel = ParallelConfig(tensor_parallel_size=2, timeout_s=10)
    workers = Workers.start(parallel, read_config(path), "cpu", path, torch.float32, narrow=False)
    worker = workers.processes[0]
    try:
        target = load_target(path, dtype=torch.float32, shard=workers.shard)
        config = EngineConfig(max_num_seqs=1, max_model_len=256, graph_mode="eager")
        engine = Engine(target, None, AutoTokenizer.from_pretrained(path), config, workers)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=50))
        engine.step()
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1 stopped answering after \d+ of the \d+ forwards sent"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 30
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        workers.close()


class _StartingRank:
    """What `_await_spawned` reads of a spawned rank's process: running (exit code None) until killed."""

    exitcode = None

    def kill(self) -> None:
        self.exitcode = -9


def test_spawned_ranks_wait_for_each_other_past_a_short_collective_timeout():
    """A spawned rank starts a process and imports torch before it joins, which a busy machine may take longer than
    `timeout_s`: the driver waits `SPAWN_TIMEOUT_S` at least for it, so a rank two seconds late still joins an engine
    whose collectives time out after half a second."""
    from tandem.engine.workers import _await_spawned, _free_port, _spawn_store

    parallel = ParallelConfig(tensor_parallel_size=2, timeout_s=0.5)
    port, joined = _free_port(), []

    def late_rank():
        time.sleep(2)
        joined.append(_spawn_store(port, 1, parallel))

    host = _spawn_store(port, 0, parallel)
    thread = threading.Thread(target=late_rank)
    thread.start()
    _await_spawned(host, [_StartingRank()], queue.SimpleQueue(), parallel)
    thread.join()
    host.set("ready", "yes")
    assert joined[0].get("ready") == b"yes"


def test_a_rank_that_never_joins_is_named_when_the_wait_ends(monkeypatch):
    from tandem.engine import workers

    monkeypatch.setattr(workers, "SPAWN_TIMEOUT_S", 1.0)
    parallel = ParallelConfig(tensor_parallel_size=2, timeout_s=0.5)
    rank = _StartingRank()
    with pytest.raises(WorkerError, match=r"rank 1 did not join the engine's ranks within 1 s"):
        workers._await_spawned(
            workers._spawn_store(workers._free_port(), 0, parallel), [rank], queue.SimpleQueue(), parallel
        )
    assert rank.exitcode == -9  # stopped


def _decodes(llm: LLM) -> None:
    """The parallel `llm` decodes four tokens of a prompt; then it is closed."""
    try:
        (out,) = llm.generate(llm.chat_prompt([{"role": "user", "content": PROMPTS[0]}]), SamplingParams(max_tokens=4))
        assert len(out.token_ids) == 4
    finally:
        llm.close()


def _worker_without_its_device(rank, parallel, device, port, errors):
    """A spawned worker given a CUDA device on a machine without one: it fails before it joins."""
    from tandem.engine.workers import _spawned_worker

    _spawned_worker(rank, parallel, torch.device("cuda", 0), port, errors)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the worker's failure needs a machine without CUDA")
def test_a_rank_that_fails_before_joining_ends_the_start_with_its_traceback(monkeypatch):
    """The engine's start names the rank and its error as soon as the rank exits, instead of waiting
    `SPAWN_TIMEOUT_S` for it to join; the process can then start ranks again."""
    from tandem.engine import workers

    monkeypatch.setattr(workers, "_spawned_worker", _worker_without_its_device)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)rank 1 exited with code 1 before joining.*rank 1 failed:.*set_device"):
        build("demo-llama", tensor_parallel_size=2)
    assert time.monotonic() - start < 60
    monkeypatch.undo()
    _decodes(build("demo-llama", tensor_parallel_size=2))


def test_ranks_start_after_a_failed_process_group_start_in_the_same_process():
    """A failed `init_process_group` (here: a peer that never comes) leaves torch's group-name counter a step
    ahead; the ranks an engine then spawns from this process must still meet it (their first group's keys named
    as a fresh process names them), not wait out `timeout_s` and fail."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=1)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timeout)
    with pytest.raises(dist.DistStoreError):
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timeout)
    assert not dist.is_initialized()
    _decodes(build("demo-llama", tensor_parallel_size=2, parallel_timeout_s=20))


def test_a_torchrun_rank_that_hangs_is_named_within_the_timeout(tmp_path):
    """Under torchrun no rank is the driver's child: rank 0 names the stopped rank from the counts every rank
    keeps in the process group's store (tests/engine/torchrun_hang.py); the ranks are then gone, and a later
    engine is refused at once."""
    from tests.engine.torchrun_hang import TIMEOUT_S

    done = torchrun(2, str(Path(__file__).with_name("torchrun_hang.py")), str(tmp_path / "pid"), timeout=240)
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, done.stderr[-4000:]
    assert re.match(r"rank 1 stopped answering after \d+ of the \d+ forwards sent", reports[0]["error"])
    assert reports[0]["seconds"] < TIMEOUT_S + 25
    assert "cannot be started again" in reports[0]["again"]
    assert reports[0]["again_seconds"] < TIMEOUT_S
