"""The paper plan for scale: per-rank weights, KV cache and bytes sent per step, for real model shapes; prints JSON.

    python benchmarks/parallel_plan.py [--batch 1 32 --k 4]

For Llama-3.1-8B and -70B at tensor_parallel_size 1/2/4/8 and DeepSeek-V3 at data-parallel attention with expert
parallel over 8/16 ranks, each model is built on the meta device, as each rank builds its shard (so nothing is
allocated), and one decode step (``batch`` rows of one token) and one verify step (``batch`` rows of ``k + 1``
tokens) run through it with the collectives replaced by a counter of the tensors they are given. So the figures
are what tandem's own layers send, not a formula beside them:

- weights: bytes of the rank's parameters in bfloat16 (tandem dequantizes DeepSeek's FP8 at load), for rank 0
  (which keeps the whole embedding and LM head its drafts read) and for the other ranks;
- KV cache: bytes per position of a row on the rank that holds it (DeepSeek: the rank that owns the row);
- sent: bytes each rank sends per step with ring collectives (an all-reduce of B bytes sends 2 (N - 1) / N B,
  an all-gather of N pieces of B bytes sends (N - 1) B), plus what the driver sends the workers (the token ids,
  as int64; the pickled control message is a few hundred bytes more);
- DeepSeek-V3's MTP draft, which follows the target's layout: its layer's bytes on the rank, and what one chained
  draft pass over ``batch`` rows of one token sends (the driver's broadcast of the chosen ids included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from torch import Tensor

from tandem.models.base import ForwardBatch
from tandem.models.config import DeepseekV3Config, LlamaConfig
from tandem.models.deepseek_v3 import DeepseekV3
from tandem.models.drafts.mtp import MultiTokenPredictor
from tandem.models.llama3 import Llama3
from tandem.models.parallel import Shard

LLAMA_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
LLAMA_70B["num_attention_heads"] = 64
DEEPSEEK_V3 = {  # config.json of deepseek-ai/DeepSeek-V3, the fields tandem reads
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}
PLANS = [
    ("Llama-3.1-8B", Llama3, LlamaConfig, LLAMA_8B, [Shard(0, n) for n in (1, 2, 4, 8)]),
    ("Llama-3.1-70B", Llama3, LlamaConfig, LLAMA_70B, [Shard(0, n) for n in (1, 2, 4, 8)]),
    (
        "DeepSeek-V3",
        DeepseekV3,
        DeepseekV3Config,
        DEEPSEEK_V3,
        [Shard(0, n, data_parallel_attention=True, expert_parallel=True) for n in (8, 16)],
    ),
]


@dataclasses.dataclass(frozen=True)
class CountingShard(Shard):
    """A shard whose collectives count the bytes each rank sends (ring algorithms) instead of communicating."""

    sent: list = dataclasses.field(default_factory=list, compare=False)

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.parallel:
            self.sent.append(2 * (self.size - 1) * x.nbytes // self.size)
        return x

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        if not self.parallel:
            return x
        self.sent.append((self.size - 1) * x.nbytes)
        return torch.cat([x] * self.size, dim=dim)


def step_bytes(model, shard: CountingShard, rows: int, per_row: int) -> int:
    """Bytes one rank sends in a forward of ``rows`` rows of ``per_row`` tokens after a 16-token prefix."""
    cache = model.new_cache(rows * shard.size, 32)
    slots = list(range(rows))
    model.forward(ForwardBatch.from_rows([[1] * 16] * rows, [0] * rows, slots, device="meta"), cache)
    shard.sent.clear()
    batch = ForwardBatch.from_rows([[1] * per_row] * rows, [16] * rows, slots, device="meta")
    model.forward(batch, cache)
    ids = batch.num_tokens * 8 * (shard.size - 1) if shard.rank == 0 else 0  # the driver's broadcast of the ids
    return sum(shard.sent) + ids


def draft_pass_bytes(draft: MultiTokenPredictor, shard: CountingShard, rows: int) -> int:
    """Bytes one rank sends in a chained MTP pass of ``rows`` rows of one token after a 16-token first pass."""
    cache = draft.new_cache(rows * shard.size, 32)
    slots = list(range(rows))
    hidden = torch.empty(rows * 16, draft.eh_proj.out_features, dtype=torch.bfloat16, device="meta")
    draft.step(ForwardBatch.from_rows([[1] * 16] * rows, [1] * rows, slots, device="meta"), hidden, cache)
    shard.sent.clear()
    batch = ForwardBatch.from_rows([[1]] * rows, [17] * rows, slots, device="meta")
    draft.step(batch, hidden[:rows], cache)
    ids = rows * 8 * (shard.size - 1) if shard.rank == 0 else 0
    return sum(shard.sent) + ids


def plan(name: str, model_class, config_class, raw: dict, shard: Shard, batches: list[int], k: int) -> dict:
    config = config_class.from_dict(raw)
    ranks = {}
    for rank in sorted({0, min(1, shard.size - 1)}):
        counting = CountingShard(**{**dataclasses.asdict(shard), "rank": rank, "group": None})
        model = model_class(config, dtype=torch.bfloat16, device="meta", shard=counting)
        entry = {"weight_gb": round(sum(p.nbytes for p in model.parameters()) / 1e9, 3)}
        entry["kv_kb_per_position"] = round(model.new_cache(1, 1).bytes_per_position / 1e3, 2)
        for batch in batches:
            entry[f"decode_batch{batch}_sent_kb"] = round(step_bytes(model, counting, batch, 1) / 1e3, 1)
            entry[f"verify_k{k}_batch{batch}_sent_kb"] = round(step_bytes(model, counting, batch, k + 1) / 1e3, 1)
        if getattr(config, "num_nextn_predict_layers", 0):
            draft = MultiTokenPredictor(config, model, dtype=torch.bfloat16, device="meta", shard=counting)
            entry["mtp_weight_gb"] = round(sum(p.nbytes for p in draft.parameters()) / 1e9, 3)
            for batch in batches:
                entry[f"mtp_pass_batch{batch}_sent_kb"] = round(draft_pass_bytes(draft, counting, batch) / 1e3, 1)
        ranks["rank0" if rank == 0 else "other_ranks"] = entry
    layout = {"tensor_parallel_size": shard.size}
    if shard.data_parallel_attention:
        layout = {"data_parallel_size": shard.size, "enable_expert_parallel": shard.expert_parallel}
    return {"model": name, **layout, **ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    plans = [plan(*entry[:4], shard, args.batch, args.k) for entry in PLANS for shard in entry[4]]
    print(json.dumps({"dtype": "bfloat16", "plans": plans}, indent=2))


if __name__ == "__main__":
    main()
