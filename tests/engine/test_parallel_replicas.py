"""Tensor-parallel engine replicas (a Llama model at tensor_parallel_size 2 x data_parallel_size 2, vLLM's
`--tensor-parallel-size 2 --data-parallel-size 2`): two engines of two ranks each, four processes on the CPU (gloo),
decode what one device decodes; a layout the machine cannot run, and a replica that cannot start, are named. Every
replica takes every setting given to `LLM`, and the replicas start side by side.

Float32, greedy: an all-reduce sums the ranks' partial products in another order than one matmul does (a few ulps
of the logits), far below the demo model's gaps between its best two tokens (tests/engine/test_parallel.py).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.replicas import ReplicaProcesses, ReplicatedEngine, replica_devices
from tandem.engine.workers import ParallelConfig, WorkerError
from tandem.llm import resolve_model
from tests.engine.test_parallel import TRIP, torchrun

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks per replica need two CPU cores")

QUESTIONS = ["Plan a weekend trip to Lisbon.", "List three prime numbers.", "Name two rivers.", "Count to five."]


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _build(draft: str | None, **settings) -> LLM:
    return LLM(
        "demo-llama", draft, dtype=torch.float32, max_num_seqs=2, max_model_len=512, graph_mode="eager", **settings
    )


@pytest.fixture
def one_thread(monkeypatch):
    """One thread per process, this one's and the spawned ones' (four processes share the cores)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tensor_parallel_replicas_decode_what_one_device_does(one_thread):
    """Each of the two replicas gets half the requests (least loaded) and runs them on its two ranks; every request's
    tokens are one device's, plain and with EAGLE-3 (the draft counts may differ: adaptive speculation picks the
    drafts per step from measured times)."""
    runs = {"greedy": SamplingParams(max_tokens=16), "schema": SamplingParams(max_tokens=32, json_schema=TRIP)}
    plain, single = _build(None), _build("eagle3")
    prompts = [single.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = {name: single.generate(prompts, params) for name, params in runs.items()}
    for want, base in zip(expected["greedy"], plain.generate(prompts, runs["greedy"])):
        assert want.token_ids == base.token_ids
    replicated = _build("eagle3", tensor_parallel_size=2, data_parallel_size=2)
    try:
        engine = replicated.engine
        assert isinstance(engine, ReplicatedEngine) and engine.num_replicas == 2
        assert replicated.workers is not None and len(replicated.workers.processes) == 1  # replica 0: ranks 0, 1
        (rank1,) = _children(engine.remotes[0].process.pid)  # replica 1's process drives its own rank 1
        got = {name: replicated.generate(prompts, params) for name, params in runs.items()}
        assert engine.assigned == [4, 4]
    finally:
        replicated.close()
    assert not Path(f"/proc/{rank1}").exists()  # replica 1 stopped its worker before it exited
    for name in runs:
        for want, out in zip(expected[name], got[name]):
            assert out.token_ids == want.token_ids, f"{name}: {out.text!r} != {want.text!r}"
    for out in got["schema"]:
        jsonschema.validate(json.loads(out.text), TRIP)
    assert all(out.stats.accepted for out in got["greedy"])  # on both replicas the draft ran and was verified


def test_torchrun_ranks_run_the_replicas_and_decode_what_one_engine_does():
    """`torchrun --nproc-per-node 4`, tensor_parallel_size 2 x data_parallel_size 2: ranks 2 and 3 run replica 1
    (tests/engine/torchrun_replicas.py), which takes half the requests, then a second engine's replica after the
    first closed; every request's tokens are one device's."""
    single = {draft: _build(draft) for draft in ("eagle3", None)}
    prompts = [single["eagle3"].chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = {
        draft or "plain": [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16))]
        for draft, llm in single.items()
    }
    program = Path(__file__).with_name("torchrun_replicas.py")
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = torchrun(4, str(program), json.dumps(prompts), timeout=300, env=one_thread)
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(reports) == 1, done.stderr[-4000:]
    for name, tokens in expected.items():
        assert reports[0][name]["assigned"] == [2, 2]
        assert reports[0][name]["tokens"] == tokens, name


def test_a_layout_the_machine_cannot_run_is_refused_naming_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="data_parallel_size 2 and tensor_parallel_size 0 must be at least 1"):
        replica_devices(2, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="data_parallel_size 0 and tensor_parallel_size 2 must be at least 1"):
        replica_devices(0, 2, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    assert replica_devices(3, 2, torch.device("cuda")) == [torch.device("cuda", i) for i in (0, 2, 4)]
    message = "data_parallel_size 2 x tensor_parallel_size 2 = 4 GPUs from cuda:3, but this machine has 6 GPUs"
    with pytest.raises(ValueError, match=message):
        replica_devices(2, 2, torch.device("cuda:3"))
    with pytest.raises(ValueError, match="data_parallel_size 4 x tensor_parallel_size 2 = 8 GPUs from cuda:0"):
        LLM("demo-llama", device="cuda", tensor_parallel_size=2, data_parallel_size=4)  # refused before loading
    with pytest.raises(ValueError, match="ParallelConfig.timeout_s = 0 must be positive"):
        LLM("demo-llama", tensor_parallel_size=2, parallel_timeout_s=0)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert replica_devices(2, 2, torch.device("cpu")) == [torch.device("cpu")] * 2  # 4 ranks share the 2 cores
    with pytest.raises(ValueError, match="data_parallel_size 3 engine replicas but this machine has 2 CPU cores"):
        replica_devices(3, 1, torch.device("cpu"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    message = "data_parallel_size 3 x tensor_parallel_size 1 = 3 ranks .* but torchrun started 4"
    with pytest.raises(ValueError, match=message):
        replica_devices(3, 1, torch.device("cpu"))
    assert replica_devices(2, 2, torch.device("cpu")) == [torch.device("cpu")] * 2  # ranks 0-1 and 2-3
    assert replica_devices(4, 1, torch.device("cpu")) == [torch.device("cpu")] * 4
    deepseek = json.loads((resolve_model("demo-deepseek") / "config.json").read_text())
    with pytest.raises(ValueError, match=r"torchrun started 4 ranks, but .* data_parallel_size 2 = 2$"):
        ParallelConfig(data_parallel_size=2).check(deepseek, torch.device("cpu"))  # one engine: all the ranks
    llama = json.loads((resolve_model("demo-llama") / "config.json").read_text())
    ParallelConfig(tensor_parallel_size=2).check(llama, torch.device("cpu"))  # one of two replicas
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"torchrun started 3 ranks, .* = 2 \(or, engine replicas, a multiple of it\)"):
        ParallelConfig(tensor_parallel_size=2).check(llama, torch.device("cpu"))


def test_every_replica_takes_the_settings_and_starts_before_replica_0_loads(monkeypatch):
    """The engine settings given to `LLM` (adaptive off, a smaller block, no prefix caching, a smaller step budget)
    are replica 1's too, and its process is running while this process loads replica 0's target."""
    from tandem.models import loading

    replica_running_at_load, real_load_target = [], loading.load_target

    def load_target(*args, **kwargs):
        children = [child.name for child in multiprocessing.active_children()]
        replica_running_at_load.append("tandem-replica1" in children)
        return real_load_target(*args, **kwargs)

    monkeypatch.setattr(loading, "load_target", load_target)
    settings = {"adaptive": False, "block_size": 8, "enable_prefix_caching": False, "max_num_batched_tokens": 32}
    llm = LLM("demo-llama", max_num_seqs=1, max_model_len=128, graph_mode="eager", data_parallel_size=2, **settings)
    try:
        configs = llm.engine.configs
    finally:
        llm.close()
    assert replica_running_at_load == [True]  # this process loaded one target (replica 0's), replica 1 running
    assert len(configs) == 2 and configs[1] == configs[0]
    for name, value in settings.items():
        assert [getattr(config, name) for config in configs] == [value, value], name


def test_a_replica_that_cannot_start_is_named_and_the_others_are_stopped():
    """Replica 2 fails while replica 1 is still building (it would for ten minutes): the failure is named at once,
    and replica 1 is stopped."""
    building = functools.partial(time.sleep, 600)
    broken = functools.partial(LLM, "demo-llama", tensor_parallel_size=4)  # 6 heads do not divide over 4 ranks
    replicas = ReplicaProcesses([building, broken])
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)replica 2 failed to start:.*num_attention_heads: 6 does not divide"):
        replicas.wait_ready()
    assert time.monotonic() - started < 120
    assert not any(remote.process.is_alive() for remote in replicas.remotes)


def test_a_replica_still_building_past_the_timeout_is_named_and_stopped():
    """A replica whose build hangs ends start-up within the timeout, named, its process stopped."""
    replicas = ReplicaProcesses([functools.partial(time.sleep, 600)])
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"replica 1 did not start within 3 s"):
        replicas.wait_ready(timeout_s=3)
    assert 3 <= time.monotonic() - started < 60
    assert not any(remote.process.is_alive() for remote in replicas.remotes)
