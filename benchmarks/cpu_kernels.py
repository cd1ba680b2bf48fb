"""The CPU's C kernels over one forward's linears and norms, against the torch paths they replace.

A shipped demo model is loaded as the engine loads it on the CPU (float32, its matmul weights narrowed to
bfloat16: ``tandem.models.linear.narrow_exact_weights``), and every linear of one target forward (each layer's
QKV, output, gate/up and down projections, then the LM head) runs on ``rows`` float32 rows, in order:

- ``kernel_us``: through :func:`tandem.models.linear.linear`, the C kernel where it applies (a step's weights
  cycle through the caches as in a forward, so they come from the last-level cache or memory);
- ``kernel_hot_us``: the same calls, each on the first weight of its shape, so a few weights that stay in the
  core's own caches: the kernel's arithmetic alone, what the cold run's memory traffic adds to;
- ``f_linear_us``: ``F.linear`` on each weight widened to float32 per call, the path of a CPU with neither AVX-512
  nor AVX2 (and of a step past ``cpu_linear.MAX_ROWS`` rows). ``kernel`` names the C build timed (the fastest this
  CPU runs; ``TANDEM_CPU_LINEAR=avx2`` times the AVX2 build on an AVX-512 CPU).

Then every RMSNorm of the forward on ``rows`` rows: ``norm_kernel_us`` through the C kernel
(:mod:`tandem.kernels.cpu_norm`), ``norm_torch_us`` through torch's ops (the path without the kernel). And, for
steps the paged-attention kernel takes (at most ``FOLD_MAX_QUERY`` tokens), a whole forward of ``rows`` tokens of
one row at ``--context`` tokens of context, its attention through the C kernel (:mod:`tandem.kernels.cpu_attention`,
``forward_kernel_attention_us``) and through gather + sdpa (``forward_torch_attention_us``).

Each is the fastest of ``--repeats`` timed loops (timeit's rule: slower loops measure the machine's other load).
One thread, as the engine runs steps of few tokens. Prints one JSON object (the last line of stdout).

    python benchmarks/cpu_kernels.py [--models demo-llama demo-deepseek] [--rows 1 5 8 40] [--context 200]
                                     [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from tandem.kernels import cpu_attention, cpu_linear, cpu_norm
from tandem.llm import resolve_model
from tandem.models import ForwardBatch, attention, load_target
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
def bench_model(model: str, rows: list[int], repeats: int, context: int = 200) -> dict:
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
        row.update(attention_times(target, m, context, repeats))
        results[f"rows_{m}"] = row
    return results


def switched_times(module, switch: str, settings: list[tuple[str, object]], calls: list, repeats: int) -> dict:
    """``{name: microseconds}`` of ``calls`` with ``module.<switch>`` at each setting's value in turn (the switch
    the layers read at every call), restored afterwards."""
    chosen, times = getattr(module, switch), {}
    try:
        for name, value in settings:
            setattr(module, switch, value)
            times[name] = round(fastest_us(calls, repeats), 1)
    finally:
        setattr(module, switch, chosen)
    return times


def norm_times(norms: list[RMSNorm], rows: int, repeats: int) -> dict:
    """Every norm of a forward on ``rows`` rows through torch's ops, and through the C kernel where it is built
    (switched as the layers read it: ``cpu_norm._AVAILABLE``)."""
    inputs = {n.weight.shape[0]: torch.randn(rows, n.weight.shape[0]) for n in norms}
    calls = [lambda n=n: n(inputs[n.weight.shape[0]]) for n in norms]
    built = cpu_norm.available()
    settings = [("norm_torch_us", False), *([("norm_kernel_us", True)] if built else [])]
    times = switched_times(cpu_norm, "_AVAILABLE", settings, calls, repeats)
    if built:
        times["norm_kernel_over_torch"] = round(times["norm_kernel_us"] / times["norm_torch_us"], 3)
    return times


def attention_times(target, rows: int, context: int, repeats: int) -> dict:
    """A forward of ``rows`` tokens of one row at ``context`` tokens of context, its attention through gather + sdpa
    and, where the CPU's kernel takes such a step, through it (switched as the layers read it:
    ``attention.attention_backend``); nothing for longer steps, which keep sdpa."""
    if rows > attention.FOLD_MAX_QUERY:
        return {}
    g = torch.Generator().manual_seed(0)
    cache = target.new_cache(1, context + rows)
    target.forward(
        ForwardBatch.from_rows([torch.randint(target.vocab_size, (context,), generator=g).tolist()], [0], [0]), cache
    )
    step = ForwardBatch.from_rows([torch.randint(target.vocab_size, (rows,), generator=g).tolist()], [context], [0])

    def forward():
        cache.truncate([0], [context])
        target.forward(step, cache)

    built = cpu_attention.available()
    settings = [("forward_torch_attention_us", "torch"), *([("forward_kernel_attention_us", "auto")] if built else [])]
    times = switched_times(attention, "attention_backend", settings, [forward], max(repeats // 20, 1))
    if built:
        times["forward_kernel_over_torch_attention"] = round(
            times["forward_kernel_attention_us"] / times["forward_torch_attention_us"], 3
        )
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo-llama", "demo-deepseek"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 40])
    parser.add_argument("--context", type=int, default=200, help="tokens of context of the attention's forwards")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    report = {
        "machine": platform.processor() or platform.machine(),
        "kernel": cpu_linear.ISA,  # the C linear's build (None: off or not built)
        "norm_kernel": cpu_norm.available(),
        "attention_kernel": cpu_attention.available(),
        "threads": 1,
        "models": {},
    }
    for model in args.models:
        report["models"][model] = bench_model(model, args.rows, args.repeats, args.context)
        print(model, json.dumps(report["models"][model]))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
