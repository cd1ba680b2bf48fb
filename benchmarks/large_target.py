"""A Llama-3.1-8B-shaped target with random bf16 weights: plain decode against the memory roofline and transformers.

    python benchmarks/large_target.py [--device cuda] [--layers 32] [--tokens 128] [--skip-transformers]

Builds transformers' ``LlamaForCausalLM`` on the device (random initialisation; hidden 4096, 32 layers, 32
heads / 8 KV heads, intermediate 14336, vocabulary 128,256 by default) and tandem's Llama 3 provider over
the same weights, handed over key by key as a checkpoint's would be. Then, in one run:

- ``bandwidth_gbs``: a device-to-device copy of ``--copy-gib``, bytes read and written over its time;
- ``roofline_ms``: the weights' bytes over that bandwidth, a batch-1 decode step's memory floor, and
  ``roofline_tokens_per_s`` its inverse;
- tandem, eager and graph mode: the engine's plain greedy decode of ``--tokens`` tokens at batch 1 (one
  row that ignores EOS): ``wall_ms`` and ``device_ms`` per step (``graph_steps.measure_case``),
  ``tokens_per_s`` and its share of the roofline's. Graph mode runs once per ``--attention``: ``cudnn``
  (the default: sdpa, cuDNN's kernel inside graphs), ``sdpa`` (sdpa's flash and memory-efficient kernels
  only) and ``triton`` (the paged-attention kernel, ``TANDEM_ATTENTION=auto``), and per ``--cuda-compile``:
  ``none``, graphs over eager kernels, or ``inductor``, over the body compiled by inductor
  (``$TANDEM_CUDA_COMPILE_BACKEND``; the case's key ends in ``_inductor``). Each graph-mode case names its
  ``--top-kernels`` heaviest kernels (microseconds per step) and its kernels per step; and per
  ``--async-scheduling`` (``on``: the case's key ends in ``_async``), each step launched before the last one's
  token is read;
- transformers: ``generate`` (greedy, ``min_new_tokens`` = ``max_new_tokens`` = ``--tokens``) with a static
  cache, which compiles its forward with torch.compile; tokens/s of a second call (the first compiles),
  prefill included, and tandem's end-to-end tokens/s for the same prompt and tokens beside it.

Smaller shapes (``--layers``, ``--hidden``, ...) run the same code on a CPU (tests/test_benchmarks.py).
One JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import torch
from graph_steps import measure_case, sync

from tandem import SamplingParams
from tandem.engine.engine import Engine, EngineConfig
from tandem.engine.graphs import CUDA_BACKEND_ENV
from tandem.llm import ASSETS_DIR
from tandem.models import attention, llama3
from tandem.models.config import LlamaConfig
from tandem.models.loading import load_tokenizer


class StateDictWeights:
    """A :class:`~tandem.models.loading.WeightReader` over a module's state dict (same keys as its checkpoint)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state, self.taken = state, set()

    def take(self, key: str, shape: tuple[int, ...], *, dtype: torch.dtype, part=None) -> torch.Tensor:
        tensor = self.state[key]
        if part is not None or tuple(tensor.shape) != shape:
            raise ValueError(f"{key}: stored {tuple(tensor.shape)}, wanted {shape} (part {part})")
        self.taken.add(key)
        return tensor.to(dtype)

    def finish(self, ignore=()) -> None:
        missing = set(self.state) - self.taken - {"lm_head.weight"}
        if missing:
            raise ValueError(f"weights never read: {sorted(missing)[:4]}")


def hf_model(args: argparse.Namespace, dtype: torch.dtype):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    config = HFLlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=131072, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def tandem_target(model) -> llama3.Llama3:
    """tandem's Llama 3 provider over ``model``'s weights (copies, on its device and in its dtype)."""
    config = LlamaConfig.from_dict(model.config.to_dict())
    return llama3.build(config, StateDictWeights(model.state_dict()), dtype=model.dtype, device=model.device)


def bandwidth_gbs(device: torch.device, gib: float) -> float:
    """Bytes read and written per second by a device-to-device copy of ``gib`` GiB, best of ten."""
    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best / 1e9


# --attention: how graph mode's attention runs, as (TANDEM_ATTENTION, sdpa's backends inside a graph)
ATTENTION = {
    "cudnn": ("torch", attention.GRAPH_SDPA_BACKENDS),
    "sdpa": ("torch", attention.CUDA_SDPA_BACKENDS),
    "triton": ("auto", attention.GRAPH_SDPA_BACKENDS),
}


def tandem_engine(target, tokenizer, mode: str, max_len: int, async_scheduling: bool = False) -> Engine:
    config = EngineConfig(
        max_num_seqs=1,
        max_model_len=max_len,
        graph_mode=mode,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    return Engine(target, None, tokenizer, config)


def end_to_end_s(engine: Engine, prompt: list[int], tokens: int) -> float:
    """Seconds for ``tokens`` new tokens after ``prompt`` (prefill included), through any EOS."""
    engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    sync(engine.device)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync(engine.device)
    return time.perf_counter() - start


def transformers_tokens_per_s(model, prompt: list[int], tokens: int) -> float:
    ids = torch.tensor([prompt], device=model.device)
    kwargs = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, "cache_implementation": "static"}
    model.generate(ids, **kwargs)  # compiles
    sync(model.device)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    sync(model.device)
    return (out.shape[1] - len(prompt)) / (time.perf_counter() - start)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--steps", type=int, default=32, help="timed (and profiled) engine steps")
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--graph-mode", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--attention", nargs="+", choices=sorted(ATTENTION), default=["cudnn", "sdpa", "triton"])
    parser.add_argument("--cuda-compile", nargs="+", choices=["none", "inductor"], default=["none", "inductor"])
    parser.add_argument("--top-kernels", type=int, default=8, help="graph-mode cases: the heaviest kernels named")
    parser.add_argument("--async-scheduling", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    torch.manual_seed(0)
    model = hf_model(args, dtype)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    target = tandem_target(model)
    report = {"benchmark": "large_target", "device": str(device), "weight_gb": round(weight_bytes / 1e9, 2)}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        report["bandwidth_gbs"] = round(bandwidth_gbs(device, args.copy_gib), 1)
        report["roofline_ms"] = round(weight_bytes / report["bandwidth_gbs"] / 1e6, 3)
        report["roofline_tokens_per_s"] = round(1000 / report["roofline_ms"], 1)
    print(json.dumps(report), flush=True)
    tokenizer = load_tokenizer(ASSETS_DIR / "demo-llama")
    prompt = torch.randint(len(tokenizer), (32,), generator=torch.Generator().manual_seed(1)).tolist()
    warmup = 4  # engine steps before timing
    max_len = len(prompt) + max(args.tokens, warmup + 3 * args.steps) + 8
    cases = {}  # the report's key -> graph mode, attention, the backend compiled inside CUDA graphs
    for mode in args.graph_mode:
        for name in args.attention if mode == "compiled" else ["cudnn"]:
            for inside in args.cuda_compile if mode == "compiled" else ["none"]:
                for overlap in args.async_scheduling:
                    key = f"tandem_{mode}" + (f"_{name}" if mode == "compiled" else "")
                    key += ("" if inside == "none" else f"_{inside}") + ("_async" if overlap == "on" else "")
                    cases[key] = mode, name, inside, overlap == "on"
    for path, (mode, name, inside, overlap) in cases.items():
        attention.attention_backend, attention.GRAPH_SDPA_BACKENDS = ATTENTION[name]
        os.environ.pop(CUDA_BACKEND_ENV, None)
        if inside != "none":
            os.environ[CUDA_BACKEND_ENV] = inside
        engine = tandem_engine(target, tokenizer, mode, max_len, overlap)
        top = args.top_kernels if mode == "compiled" else 0
        timing = SimpleNamespace(warmup=warmup, steps=args.steps, k=0, top_kernels=top)
        row = {"path": path, **measure_case(engine, [prompt], timing)}
        row["end_to_end_tokens_per_s"] = round(args.tokens / end_to_end_s(engine, prompt, args.tokens), 1)
        if "roofline_tokens_per_s" in report:
            row["of_roofline"] = round(row["tokens_per_s"] / report["roofline_tokens_per_s"], 3)
        report[path] = row
        print(json.dumps(row), flush=True)
        del engine
    if not args.skip_transformers:
        rate = transformers_tokens_per_s(model, prompt, args.tokens)
        report["transformers_static_compiled_tokens_per_s"] = round(rate, 1)
        for path in cases:
            report[f"{path}_over_transformers"] = round(report[path]["end_to_end_tokens_per_s"] / rate, 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
