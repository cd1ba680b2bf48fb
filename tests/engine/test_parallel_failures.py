"""A worker or replica that dies or hangs ends the engine with an error naming it, within a bounded time.

Apart from tests/engine/test_parallel.py, whose module fixtures keep two-process LLMs running: these tests start and
break their own ranks, and a process runs one layout of ranks at a time, so they must not meet a running one.
"""

from __future__ import annotations

import json
import os
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


def test_spawned_ranks_wait_for_each_other_past_a_short_collective_timeout():
    """A spawned rank starts a process and imports torch before it joins, which a busy machine may take longer than
    `timeout_s`: joining the ranks' store waits `SPAWN_TIMEOUT_S` at least, so a rank two seconds late still joins
    an engine whose collectives time out after half a second."""
    from tandem.engine.workers import _free_port, _spawn_store

    parallel = ParallelConfig(tensor_parallel_size=2, timeout_s=0.5)
    port, joined = _free_port(), []

    def late_rank():
        time.sleep(2)
        joined.append(_spawn_store(port, 1, parallel))

    thread = threading.Thread(target=late_rank)
    thread.start()
    host = _spawn_store(port, 0, parallel)  # waits for rank 1
    thread.join()
    host.set("ready", "yes")
    assert joined[0].get("ready") == b"yes"


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
