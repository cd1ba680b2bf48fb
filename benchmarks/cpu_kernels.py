"""The CPU's C kernels over one forward's linears and norms, against the torch paths they replace.

A shipped demo model is loaded as the engine loads it on the CPU (float32, its matmul weights narrowed to
bfloat16: ``tandem.models.linear.narrow_exact_weights``), and every linear of one target forward (each layer's
QKV, output, gate/up and down projections, then the LM head) runs on ``rows`` float32 rows, in order:

- ``kernel_us``: through :func:`tandem.models.linear.linear`, the C kernel where it applies (a step's weights
  cycle through the caches as in a forward, so they come from the last-level cache or memory);
- ``kernel_hot_us``: the same calls, each on the first weight of its shape, so a few weights that stay in the
  core's own caches: the kernel's arithmetic alone, what the cold run's memory traffic adds to;
- ``f_linear_us``: ``F.linear`` on each weight widened to float32 per call, the path of a CPU without AVX-512
  (and of a step past ``cpu_linear.MAX_ROWS`` rows).

Then every RMSNorm of the forward on ``rows`` rows: ``norm_kernel_us`` through the C kernel
(:mod:`tandem.kernels.cpu_norm`), ``norm_torch_us`` through torch's ops (the path without the kernel).

Each is the fastest of ``--repeats`` timed loops (timeit's rule: slower loops measure the machine's other load).
One thread, as the engine runs steps of few tokens. Prints one JSON object (the last line of stdout).

    python benchmarks/cpu_kernels.py [--models demo-llama demo-deepseek] [--rows 1 5 8 40] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from tandem.kernels import cpu_linear, cpu_norm
from tandem.llm import resolve_model
from tandem.models import load_target
from tandem.models.linear import linear, narrow_exact_weights, widened
from tandem.models.norm import RMSNorm


def forward_weights(target: torch.nn.Module) -> list[torch.Tensor]:
    """The narrowed matmul weights ``[N, K]`` of one forward, in the order the forward reads them."""
    weights = [
        param
        for module in target.modules()
        for name in getattr(module, "narrowable", ())
        if (param := getattr(module, name)).dtype == torch.bfloat16
    ]
    if not weights:
        raise ValueError("no narrowed weight: the checkpoint's matmul weights are not exactly bfloat16")
    return weights


def fastest_us(calls: list, repeats: int) -> float:
    """Microseconds of the fastest of ``repeats`` loops over ``calls`` (after one untimed loop)."""
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        for call in calls:
            call()
        if i:
            best = min(best, time.perf_counter() - start)
    return best * 1e6


@torch.inference_mode()
def bench_model(model: str, rows: list[int], repeats: int) -> dict:
    target = load_target(resolve_model(model, None), dtype=torch.float32)
    narrow_exact_weights(target)
    weights = forward_weights(target)
    norms = [m for m in target.modules() if isinstance(m, RMSNorm)]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    results = {"linears": len(weights), "norms": len(norms), "weight_bytes": weight_bytes}
    for m in rows:
        inputs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}

        def calls(ws, op, inputs=inputs):
            return [lambda w=w: op(inputs[w.shape[1]], w) for w in ws]

        first_of_shape: dict[torch.Size, torch.Tensor] = {}
        hot = [first_of_shape.setdefault(w.shape, w) for w in weights]  # the same calls on a few weights
        kernel = cpu_linear.available() and m <= cpu_linear.MAX_ROWS
        row = {"f_linear_us": round(fastest_us(calls(weights, lambda x, w: F.linear(x, widened(w, x))), repeats), 1)}
        if kernel:
            row["kernel_us"] = round(fastest_us(calls(weights, linear), repeats), 1)
            row["kernel_hot_us"] = round(fastest_us(calls(hot, linear), repeats), 1)
            row["kernel_over_f_linear"] = round(row["kernel_us"] / row["f_linear_us"], 3)
            row["cold_over_hot"] = round(row["kernel_us"] / row["kernel_hot_us"], 3)
        row.update(norm_times(norms, m, repeats))
        results[f"rows_{m}"] = row
    return results


def norm_times(norms: list[RMSNorm], rows: int, repeats: int) -> dict:
    """Every norm of a forward on ``rows`` rows through torch's ops, and through the C kernel where it is built
    (switched as the layers read it: ``cpu_norm._AVAILABLE``)."""
    inputs = {n.weight.shape[0]: torch.randn(rows, n.weight.shape[0]) for n in norms}
    calls = [lambda n=n: n(inputs[n.weight.shape[0]]) for n in norms]
    built = cpu_norm.available()
    times = {}
    try:
        for name, on in (("norm_torch_us", False), ("norm_kernel_us", True))[: 2 if built else 1]:
            cpu_norm._AVAILABLE = on
            times[name] = round(fastest_us(calls, repeats), 1)
    finally:
        cpu_norm._AVAILABLE = built
    if built:
        times["norm_kernel_over_torch"] = round(times["norm_kernel_us"] / times["norm_torch_us"], 3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo-llama", "demo-deepseek"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 40])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    report = {
        "machine": platform.processor() or platform.machine(),
        "kernel": cpu_linear.available(),
        "norm_kernel": cpu_norm.available(),
        "threads": 1,
        "models": {},
    }
    for model in args.models:
        report["models"][model] = bench_model(model, args.rows, args.repeats)
        print(model, json.dumps(report["models"][model]))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
