"""Time a verify forward of k+1 tokens per row against a single-token decode step, same model and batch.

Both targets (Llama 3 and DeepSeek-V3) at small random sizes, saved with ``save_pretrained`` and
loaded through ``tandem.models.load_target``. Each row first holds ``--context`` tokens; every
timed call writes at the same positions (the cache is rolled back by truncation), so decode and
verify see identical contexts. ``verify_over_decode`` is the cost ratio that decides whether
speculation pays off: with acceptance length ``a``, speculation wins when ``a > ratio``. At a batch above 1,
``one_row_verify_over_decode`` is the cost of a step where one row verifies k+1 tokens and the others decode
(adaptive speculation's mixed steps) against a decode step.
Prints one JSON object (the last line of stdout).

    python benchmarks/models.py [--batch 1 8] [--k 4] [--context 256] [--min-run-time 1.0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import tempfile
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

from tandem.models import ForwardBatch, load_target


def _save_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)


def _save_deepseek(path: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=128,
        q_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=4096,
    )  # fmt: skip
    DeepseekV3ForCausalLM(config).save_pretrained(path)


def _median_ms(fn, min_run_time: float) -> float:
    """torch's timer: a warm-up, then blocks of calls for `min_run_time` seconds; the median block's ms per call."""
    return 1000 * Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


@torch.inference_mode()
def bench_target(path: Path, batch: int, k: int, context: int, min_run_time: float) -> dict:
    target = load_target(path)
    cache = target.new_cache(batch, context + k + 1)
    slots = list(range(batch))
    prompts = torch.randint(target.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    target.forward(ForwardBatch.from_rows(prompts.tolist(), [0] * batch, slots), cache)
    committed = [context] * batch

    def step(*num_tokens: int):
        """A forward of ``num_tokens[b]`` tokens in row b (one count: every row's)."""
        counts = list(num_tokens) if len(num_tokens) == batch else num_tokens * batch
        rows = [torch.randint(target.vocab_size, (n,)).tolist() for n in counts]
        last = [n - 1 for n in itertools.accumulate(counts)]
        decode = max(counts) == 1
        batch_ = ForwardBatch.from_rows(rows, [context] * batch, slots, logits_indices=last if decode else None)

        def run():
            cache.truncate(slots, committed)
            target.forward(batch_, cache)

        return run

    decode_ms = _median_ms(step(1), min_run_time)
    verify_ms = _median_ms(step(k + 1), min_run_time)
    result = {
        "decode_ms": round(decode_ms, 3),
        "verify_ms": round(verify_ms, 3),
        "verify_over_decode": round(verify_ms / decode_ms, 3),
    }
    if batch > 1:  # one row verifying while the others decode: adaptive speculation's probe, a row's forced run
        one_row_ms = _median_ms(step(k + 1, *[1] * (batch - 1)), min_run_time)
        result.update(
            one_row_verify_ms=round(one_row_ms, 3), one_row_verify_over_decode=round(one_row_ms / decode_ms, 3)
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds timed per step kind")
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "k": args.k,
        "context": args.context,
        "dtype": "float32",
        "targets": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, save in (("llama3", _save_llama), ("deepseek_v3", _save_deepseek)):
            path = Path(tmp) / name
            try:
                save(path)
                results = {
                    f"batch_{b}": bench_target(path, b, args.k, args.context, args.min_run_time) for b in args.batch
                }
            except (ImportError, AttributeError) as error:  # a provider module not written yet
                results = {"skipped": f"{type(error).__name__}: {error}"}
            report["targets"][name] = results
            print(name, json.dumps(results))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
