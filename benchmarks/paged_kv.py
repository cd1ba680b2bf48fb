"""Decode tokens/s of the paged KV cache against one block per row (the contiguous layout), in one process.

    python benchmarks/paged_kv.py [--model demo-llama --draft eagle3 --batch 1 8 --max-tokens 64 --repeats 3]

Both engines share the loaded models; runs alternate between them and the best of ``--repeats`` counts, so
the two see the same machine. Prefix caching is off in both: every run prefills the same prompts."""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llama")
    parser.add_argument("--draft", default="eagle3")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, args.draft, max_num_seqs=max(args.batch), max_model_len=args.max_model_len)
    dtype = next(llm.target.parameters()).dtype
    print(f"{args.model} + {args.draft}, {dtype}, {torch.get_num_threads()} threads, max_tokens {args.max_tokens}")
    base = llm.engine.config
    engines = {
        f"paged (block {args.block_size})": llm.engine,
        "contiguous (one block per row)": Engine(
            llm.target,
            llm.draft,
            llm.tokenizer,
            EngineConfig(**{**vars(base), "block_size": args.max_model_len, "enable_prefix_caching": False}),
        ),
    }
    llm.engine.blocks.enable_prefix_caching = False
    examples = generate_examples(max(args.batch), seed=5, split="heldout")
    prompts = [llm.chat_prompt(e.messages, e.tools) for e in examples]
    prompts = [llm.encode(p) for p in prompts]
    for batch in args.batch:
        best = dict.fromkeys(engines, 0.0)
        for engine in engines.values():  # warm-up
            tokens_per_second(engine, prompts[:batch], 8)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                best[name] = max(best[name], tokens_per_second(engine, prompts[:batch], args.max_tokens))
        for name, value in best.items():
            print(f"batch {batch:2d}  {name:32s} {value:8.1f} tokens/s")


if __name__ == "__main__":
    main()
