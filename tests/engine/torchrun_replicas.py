"""A torchrun program for tests/engine/test_parallel_replicas.py: a Llama model's data_parallel_size 2 x
tensor_parallel_size 2 over four torchrun ranks: replica 0 on ranks 0 and 1, replica 1 on ranks 2 and 3.

The other ranks follow rank 0 (`tandem.cli.follows_rank_zero`, as under `torchrun -m tandem.cli`): rank 2 drives the
replicas rank 0 sends it, ranks 1 and 3 run their replica's forwards. Rank 0 builds demo-llama + EAGLE-3,
generates the questions of the first argument (a JSON list of chat prompts' token ids), closes it, then does the
same without a draft (a second engine on the same ranks), and prints one JSON line: each engine's tokens and how
many requests each replica was given.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tandem import LLM, SamplingParams
from tandem.cli import follows_rank_zero

SETTINGS = {"dtype": torch.float32, "max_num_seqs": 2, "max_model_len": 512, "graph_mode": "eager"}


def main() -> None:
    layout = {"tensor_parallel_size": 2, "data_parallel_size": 2, "enable_expert_parallel": False}
    if follows_rank_zero(argparse.Namespace(model="demo-llama", device="cpu", **layout)):
        return
    prompts = json.loads(sys.argv[1])
    report = {}
    for draft in ("eagle3", None):
        llm = LLM("demo-llama", draft, device="cpu", **SETTINGS, **layout)
        try:
            outputs = llm.generate(prompts, SamplingParams(max_tokens=16))
            report[draft or "plain"] = {"tokens": [o.token_ids for o in outputs], "assigned": llm.engine.assigned}
        finally:
            llm.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
