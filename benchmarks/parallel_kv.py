"""Rows that run together in a fixed per-rank KV memory, one process against data-parallel attention; prints JSON.

    python benchmarks/parallel_kv.py [--requests 16 --blocks 24 --block-size 16 --max-tokens 32]

demo-deepseek (no draft), ``kv_cache_memory`` of ``--blocks`` blocks per rank, ``--requests`` short chat requests
queued at once (``max_num_seqs`` as many): in one process, and over two ranks with data-parallel attention and
expert parallel, where each rank's pool holds only its own rows' blocks (engine/kv_blocks.py), so the same bytes
a rank hold twice the blocks in all. For each: the pool's blocks, the most and the mean rows a step runs, steps,
preemptions, seconds (on a CPU the ranks share its cores: the rows are the point), and whether the greedy tokens
are the same.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.decoding.params import SamplingParams
from tandem.llm import LLM

TOPICS = ["Lisbon", "rivers", "primes", "tea", "chess", "bees", "rain", "maps"]
LAYOUTS = {"one_process": {}, "dp2_ep": {"data_parallel_size": 2, "enable_expert_parallel": True}}


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """The run's figures and each request's tokens."""
    engine, rows = llm.engine, []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        rows.append(len(engine.scheduler.running))
    seconds = time.perf_counter() - start
    stats = engine.kv_stats()
    figures = {
        "blocks_total": stats.blocks_total,
        "max_rows": max(rows),
        "mean_rows": round(sum(rows) / len(rows), 2),
        "steps": len(rows),
        "preemptions": stats.preemptions,
        "seconds": round(seconds, 2),
    }
    return figures, [engine.pop_finished(request_id).token_ids for request_id in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=24, help="KV blocks per rank (at least one row of 256 positions)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    settings = {
        "dtype": torch.float32,
        "max_num_seqs": args.requests,
        "max_model_len": 256,
        "block_size": args.block_size,
        "graph_mode": "eager",
    }
    probe = LLM("demo-deepseek", None, **{**settings, "max_num_seqs": 1})
    memory = probe.engine.target_cache.bytes_per_position * args.block_size * args.blocks
    prompts = [
        probe.chat_prompt([{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}, part {i}."}])
        for i in range(args.requests)
    ]
    probe.close()
    results, tokens = {}, {}
    for name, layout in LAYOUTS.items():
        llm = LLM("demo-deepseek", None, kv_cache_memory=memory, **settings, **layout)
        results[name], tokens[name] = run(llm, prompts, args.max_tokens)
        llm.close()
    same = tokens["dp2_ep"] == tokens["one_process"]
    print(json.dumps({"kv_cache_memory_per_rank": memory, **results, "same_tokens": same}, indent=2))


if __name__ == "__main__":
    main()
