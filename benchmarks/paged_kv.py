"""The paged KV cache against one block per row (the contiguous layout), in one process; prints JSON.

    python benchmarks/paged_kv.py [--model demo-llama --draft eagle3 --batch 1 8 --max-tokens 64 --repeats 3]

Speed: generated tokens/s of each layout per batch size, and their ratio. Both engines share the loaded
models; runs alternate between them and the best of ``--repeats`` counts, so the two see the same machine.
Prefix caching is off in both: every run prefills the same prompts.

Capacity: the most rows running at once when ``--rows`` short requests share a KV memory that holds
``--memory-rows`` rows of the whole context (``max_model_len``), for each layout."""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import generate_examples
from tandem.engine.engine import Engine, EngineConfig
from tandem.llm import LLM


def tokens_per_second(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens per second of wall time over ``prompts``, all queued at once."""
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    generated = sum(len(engine.pop_finished(i).token_ids) for i in ids)
    return generated / (time.perf_counter() - start)


def most_running(engine: Engine, prompts: list[list[int]], max_tokens: int) -> int:
    """The most rows the engine ran at once over ``prompts``, all queued at once."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    for i in ids:
        engine.pop_finished(i)
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llama")
    parser.add_argument("--draft", default="eagle3")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32, help="capacity: short requests queued at once")
    parser.add_argument("--memory-rows", type=int, default=2, help="capacity: KV memory, in whole-context rows")
    args = parser.parse_args()
    llm = LLM(args.model, args.draft, max_num_seqs=max(args.batch), max_model_len=args.max_model_len)
    base = llm.engine.config

    def engine(block_size: int, **config) -> Engine:
        fields = {**vars(base), "block_size": block_size, "enable_prefix_caching": False, **config}
        return Engine(llm.target, llm.draft, llm.tokenizer, EngineConfig(**fields))

    layouts = {"paged": args.block_size, "contiguous": args.max_model_len}
    engines = {name: engine(block_size) for name, block_size in layouts.items()}
    examples = generate_examples(max(max(args.batch), args.rows), seed=5, split="heldout")
    prompts = [llm.encode(llm.chat_prompt(e.messages, e.tools)) for e in examples]
    speed = []
    for batch in args.batch:
        best = dict.fromkeys(engines, 0.0)
        for e in engines.values():  # warm-up
            tokens_per_second(e, prompts[:batch], 8)
        for _ in range(args.repeats):
            for name, e in engines.items():
                best[name] = max(best[name], tokens_per_second(e, prompts[:batch], args.max_tokens))
        speed.append({"batch": batch, **{f"{n}_tokens_per_s": round(v, 1) for n, v in best.items()}})
        speed[-1]["paged_vs_contiguous"] = round(best["paged"] / best["contiguous"], 3)
    position_bytes = sum(
        c.bytes_per_position for c in (engines["paged"].target_cache, engines["paged"].draft_cache) if c
    )
    memory = args.memory_rows * args.max_model_len * position_bytes
    capacity = {
        name: most_running(engine(block_size, kv_cache_memory=memory, max_num_seqs=args.rows), prompts, 16)
        for name, block_size in layouts.items()
    }
    result = {
        "model": args.model,
        "draft": args.draft,
        "dtype": str(next(llm.target.parameters()).dtype),
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "speed": speed,
        "capacity": {"kv_cache_memory": memory, "requests": args.rows, "most_running": capacity},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
