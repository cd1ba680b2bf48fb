"""A demo pair over several processes against one process, in one run; prints JSON.

    python benchmarks/parallel.py [--layouts llama-tp2 deepseek-dp2-ep llama-tp2-dp2 --batch 1 4 --max-tokens 64
                                   --repeats 3]

``llama-tp2``: demo-llama + EAGLE-3 at tensor_parallel_size 2; ``deepseek-dp2-ep``: demo-deepseek + MTP at
data_parallel_size 2 with expert parallel; ``llama-tp2-dp2``: demo-llama + EAGLE-3 as two engine replicas of two
tensor-parallel ranks each (four processes; not run by default). Each beside the same pair in one process:
generated tokens/s per batch size (best of ``--repeats``, the two layouts alternating so both see the same
machine), their ratio, and whether the tokens are the same (greedy). On a CPU the ranks share its cores and every
layer adds an all-reduce through gloo, so the parallel run is expected slower there: the point is that it decodes
the same tokens; its speed belongs on several GPUs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import generate_examples
from tandem.llm import LLM

LAYOUTS = {  # name -> (model, draft, parallel settings)
    "llama-tp2": ("demo-llama", "eagle3", {"tensor_parallel_size": 2}),
    "deepseek-dp2-ep": ("demo-deepseek", "mtp", {"data_parallel_size": 2, "enable_expert_parallel": True}),
    "llama-tp2-dp2": ("demo-llama", "eagle3", {"tensor_parallel_size": 2, "data_parallel_size": 2}),
}


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(generated tokens per second, the tokens) of ``prompts`` queued at once."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    seconds = time.perf_counter() - start
    tokens = [out.token_ids for out in outputs]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["llama-tp2", "deepseek-dp2-ep"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    examples = generate_examples(max(args.batch), seed=5, split="heldout")
    results = []
    for label in args.layouts:
        model, draft, layout = LAYOUTS[label]
        settings = {"max_num_seqs": max(args.batch), "max_model_len": 1024, "enable_prefix_caching": False}
        llms = {"one_process": LLM(model, draft, **settings), "parallel": LLM(model, draft, **settings, **layout)}
        prompts = [llms["one_process"].chat_prompt(e.messages, e.tools) for e in examples]
        for batch in args.batch:
            best, tokens = dict.fromkeys(llms, 0.0), {}
            for llm in llms.values():
                timed(llm, prompts[:batch], 8)  # warm-up
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    rate, tokens[name] = timed(llm, prompts[:batch], args.max_tokens)
                    best[name] = max(best[name], rate)
            results.append(
                {
                    "name": label,
                    "model": model,
                    "draft": draft,
                    "layout": layout,
                    "batch": batch,
                    **{f"{name}_tokens_per_s": round(rate, 1) for name, rate in best.items()},
                    "parallel_vs_one": round(best["parallel"] / best["one_process"], 3),
                    "same_tokens": tokens["parallel"] == tokens["one_process"],
                }
            )
        llms["parallel"].close()
    print(json.dumps({"threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
