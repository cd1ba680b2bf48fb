"""A torchrun program for tests/engine/test_parallel_failures.py: two ranks of a tensor-parallel demo-llama engine,
one of which stops answering.

Rank 1 writes its pid to the file named by the first argument and follows rank 0's forwards. Rank 0 steps an
engine once, stops rank 1 (SIGSTOP), steps on until the engine ends in a WorkerError, starts workers again (which
must fail at once), prints both errors as JSON with the seconds each took, then kills rank 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tandem import SamplingParams
from tandem.engine import Engine, EngineConfig
from tandem.engine.workers import ParallelConfig, WorkerError, Workers, follow_launcher
from tandem.llm import resolve_model
from tandem.models.loading import load_target, read_config

TIMEOUT_S = 5


def main() -> None:
    pid_file = Path(sys.argv[1])
    parallel = ParallelConfig(tensor_parallel_size=2, timeout_s=TIMEOUT_S)
    if int(os.environ["RANK"]) != 0:
        pid_file.write_text(str(os.getpid()))
        follow_launcher(parallel, "cpu")
        return
    path = resolve_model("demo-llama")
    workers = Workers.start(parallel, read_config(path), "cpu", path, torch.float32, narrow=False)
    worker = int(pid_file.read_text())  # written before rank 1 joined the group that Workers.start waited for
    target = load_target(path, dtype=torch.float32, shard=workers.shard)
    config = EngineConfig(max_num_seqs=1, max_model_len=256, graph_mode="eager")
    engine = Engine(target, None, AutoTokenizer.from_pretrained(path), config, workers)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=50))
    engine.step()
    os.kill(worker, signal.SIGSTOP)
    start = time.monotonic()
    try:
        while engine.has_unfinished():
            engine.step()
        error = None
    except WorkerError as failure:
        error = str(failure)
    seconds, start = time.monotonic() - start, time.monotonic()
    try:  # the ranks are gone: a later engine is refused at once, not after the group's timeout
        Workers.start(parallel, read_config(path), "cpu", path, torch.float32, narrow=False)
        again = None
    except WorkerError as failure:
        again = str(failure)
    report = {"error": error, "seconds": seconds, "again": again, "again_seconds": time.monotonic() - start}
    print(json.dumps(report), flush=True)
    os.kill(worker, signal.SIGKILL)


if __name__ == "__main__":
    main()
