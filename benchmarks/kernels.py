"""Per-call time of the acceptance step: fused Triton kernel vs the torch reference vs xgrammar's
bitmask kernel + the torch acceptance. Prints one JSON document.

    python benchmarks/kernels.py                      # CUDA: all backends; CPU: torch ones only
    python benchmarks/kernels.py --interpret --batch-sizes 1 --vocab 4096   # Triton on the CPU

Modes: greedy (no grammar), stochastic (temperature 1, no grammar), masked (stochastic under a
grammar bitmask: the figure the issue targets, < 100 us for B = 64 on an H100). Drafts are
deterministic (one-hot q, as from EAGLE/MTP) and the target gives each p ~ 0.9, so stochastic rows
accept ~3 of 4 drafts like a well-trained draft (greedy rows all 4); `mean_accepted` reports what
each case did. The Triton path under TRITON_INTERPRET is not a meaningful timing and runs only
with --interpret.

On CUDA each case reports `us_per_call` (event-timed calls in a row: the device's time plus any
gap where it waits for the host to launch the next kernel) and `us_graph` (the same call replayed
from a CUDA graph: the device's time alone). Each case also reports whether the Triton kernel
agreed with the torch path: equal tokens (greedy) or equal accepted counts (stochastic: both paths
test drafts with the same uniforms).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable

import torch

from tandem.core.bitmask import pack_bitmask
from tandem.core.timing import median_wall_us
from tandem.decoding import SamplingTensors, accept

MODES = ("greedy", "stochastic", "masked")
BACKENDS = ("triton", "torch", "xgrammar+torch")


def make_case(mode: str, batch: int, k: int, vocab_size: int, device: str, seed: int = 0) -> dict:
    """Inputs for one accept call: target logits [B, k+1, V] float32 that favour the drafts,
    drafts [B, k], sampling and (masked mode) a bitmask [B, k+1, W] that allows the drafts."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab_size, generator=generator) * 2
    drafts = torch.randint(vocab_size, (batch, k), generator=generator)
    # The other tokens' exp-logits sum to ~V e^2; this boost gives the draft p ~ 0.9 (temperature 1).
    logits[:, :k].scatter_(-1, drafts.unsqueeze(-1), math.log(vocab_size) + 2 + math.log(9))
    bitmask = None
    if mode == "masked":
        allowed = torch.rand(batch, k + 1, vocab_size, generator=generator) < 0.5
        allowed[:, :k].scatter_(-1, drafts.unsqueeze(-1), True)
        bitmask = pack_bitmask(allowed).to(device)
    sampling = None if mode == "greedy" else SamplingTensors.full(batch, seed=torch.arange(batch), device=device)
    return {
        "target_logits": logits.to(device),
        "draft_tokens": drafts.to(device),
        "sampling": sampling,
        "bitmask": bitmask,
    }


def backend_call(backend: str, case: dict) -> Callable[[], object]:
    """A no-argument function running one acceptance step with `backend`."""
    if backend == "torch":
        return lambda: accept(**case, backend="torch")
    if backend == "triton":
        return lambda: accept(**case, backend="triton")
    from xgrammar import apply_token_bitmask_inplace

    logits, bitmask = case["target_logits"], case["bitmask"]
    rows, words = logits.view(-1, logits.shape[-1]), bitmask.view(-1, bitmask.shape[-1])
    unmasked = {**case, "bitmask": None}

    def step():
        apply_token_bitmask_inplace(rows, words)  # idempotent, so repeating it on the same logits is fair
        return accept(**unmasked, backend="torch")

    return step


def time_call(fn: Callable[[], object], iters: int) -> float:
    """Median microseconds per call (CUDA: triton's do_bench, L2 flushed between calls)."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=max(iters, 1) * 2, return_mode="median") * 1000
    return median_wall_us(fn, iters)


def graph_time(fn: Callable[[], object]) -> float | None:
    """Median microseconds per call replayed from a CUDA graph: the device's time alone, without
    the host's launch overhead (None where the call cannot be captured, e.g. it reads the device)."""
    import triton.testing

    try:
        return round(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000, 1)
    except RuntimeError:
        return None


def agreement(mode: str, case: dict) -> float:
    """Fraction of rows where the Triton kernel matches the torch path (tokens if greedy, else accepted counts)."""

    torch_result, triton_result = accept(**case, backend="torch"), accept(**case, backend="triton")
    if mode == "greedy":
        return (torch_result.tokens == triton_result.tokens).all(dim=-1).float().mean().item()
    return (torch_result.num_accepted == triton_result.num_accepted).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128_256, help="128256 = Llama 3, 129280 = DeepSeek-V3")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--iters", type=int, default=None, help="timed calls per case (default: 50 on CUDA, 3 on CPU)")
    parser.add_argument("--interpret", action="store_true", help="also run Triton on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument(
        "--block", type=int, default=None, help="vocabulary tokens per Triton program (default: the kernel's)"
    )
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before tandem.kernels is imported
    device = "cuda" if cuda else "cpu"
    iters = args.iters or (50 if cuda else 3)
    backends = [b for b in args.backends if b != "triton" or cuda or args.interpret]
    if args.block and "triton" in backends:
        from tandem.kernels import acceptance as kernel_module  # after TRITON_INTERPRET is settled

        kernel_module.MAX_BLOCK = args.block
    results = []
    for mode in args.modes:
        for batch in args.batch_sizes:
            case = make_case(mode, batch, args.k, args.vocab, device)
            for backend in backends:
                if backend == "xgrammar+torch" and case["bitmask"] is None:
                    continue  # without a grammar it is the torch path
                calls = 1 if backend == "triton" and not cuda else iters
                row = {
                    "mode": mode,
                    "batch": batch,
                    "backend": backend,
                    "us_per_call": round(time_call(backend_call(backend, case), calls), 1),
                }
                if backend == "triton":
                    row["agrees_with_torch"] = agreement(mode, case)
                if cuda:
                    row["us_graph"] = graph_time(backend_call(backend, case))
                if backend == "torch":
                    row["mean_accepted"] = accept(**case, backend="torch").num_accepted.float().mean().item()
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "k": args.k,
        "vocab_size": args.vocab,
        "dtype": "float32",
        "block": args.block,
        "note": None if cuda else "CPU: Triton runs under the interpreter only with --interpret; not a timing",
        "results": results,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
