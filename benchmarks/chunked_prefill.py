"""How long a long prompt stalls the rows already decoding, per `max_num_batched_tokens`; prints JSON.

    python benchmarks/chunked_prefill.py [--model demo-llama --prompt-tokens 1900 --budgets 0 2048 512 256]

Two short requests decode; after three steps a prompt of ``--prompt-tokens`` tokens arrives. Without chunking
(budget 0: None) its whole prefill shares one step with the short rows, which wait for it; with a budget each
step prefills at most that many tokens of it. Reported per budget: the longest step (the short rows' longest
wait between two tokens), the number of steps and the total time. One process, the same loaded model for
every budget, plain decoding."""

from __future__ import annotations

import argparse
import json
import time

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import generate_examples
from tandem.engine.engine import Engine, EngineConfig
from tandem.llm import LLM


def stall(llm: LLM, short: list[list[int]], long: list[int], budget: int | None) -> dict[str, float]:
    """The longest step, the steps and the seconds while ``long`` arrives among the decoding ``short`` rows."""
    config = EngineConfig(
        **{**vars(llm.engine.config), "max_num_seqs": len(short) + 1, "max_num_batched_tokens": budget}
    )
    engine = Engine(llm.target, llm.draft, llm.tokenizer, config)
    for prompt in short:
        engine.add_request(prompt, SamplingParams(max_tokens=64))
    for _ in range(3):
        engine.step()
    engine.add_request(long, SamplingParams(max_tokens=4))
    steps, started = [], time.perf_counter()
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return {
        "longest_step_ms": round(max(steps) * 1e3, 1),
        "steps": len(steps),
        "total_s": round(time.perf_counter() - started, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llama")
    parser.add_argument("--prompt-tokens", type=int, default=1900)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 2048, 512, 256], help="0: no chunking")
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=args.prompt_tokens + 64, graph_mode="eager")
    prompts = [llm.chat_prompt(e.messages, e.tools) for e in generate_examples(16, seed=11, split="heldout")]
    long = sum(prompts, [])[: args.prompt_tokens]
    stall(llm, prompts[2:4], long, None)  # warm-up
    runs = [{"max_num_batched_tokens": b or None, **stall(llm, prompts[2:4], long, b or None)} for b in args.budgets]
    print(json.dumps({"model": args.model, "prompt_tokens": len(long), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
