"""Paged attention per call: the Triton kernel (keys read through the block table) against the torch path
(each row's blocks gathered into a contiguous copy, then sdpa). Prints one JSON document.

    python benchmarks/paged_attention.py         # CUDA: Llama-3-8B's heads, bfloat16, contexts 1k to 16k
    python benchmarks/paged_attention.py --device cpu --heads 4 --kv-heads 2 --head-dim 16 --contexts 64 \\
        --batch-sizes 2 --max-len 128 --iters 1           # a smoke run: Triton under its interpreter
    python benchmarks/paged_attention.py --mla --heads 128 --head-dim 576 --value-dim 512   # DeepSeek-V3's MLA
    python benchmarks/paged_attention.py --mla ... --mla-tiles padded 32x16x8  # and the kernel with other tiles

Cases: decode (one query per row), verify (``k + 1`` queries, causal) and, in the eager layout, a prefill chunk
(``--prefill`` queries, causal; graph mode runs prefills eagerly), rows of ``context`` keys each in
16-position blocks shuffled over the pool, in both layouts: ``eager`` (:meth:`RaggedLayout.build`, the key
window the batch's longest row) and ``graph`` (:meth:`RaggedLayout.static`, as graph mode captures it: every
row's whole table of ``--max-len`` positions, masked by position). On CUDA ``kernel_us`` and ``torch_us`` are
the device's time per call (the call replayed from a CUDA graph, triton's ``do_bench_cudagraph``); on the CPU
they are wall times under the interpreter, not a measurement. ``max_abs_diff``: the two paths' outputs apart.
With ``--mla``, the attention is DeepSeek-V3's absorbed MLA (``attend_latent``): every query head over one latent
head of ``--head-dim`` entries, whose first ``--value-dim`` are the values. ``--mla-tiles`` times the kernel again
with other tiles for the latents, each as ``kernel_<tiles>_us`` and ``max_abs_diff_<tiles>``: ``padded`` (the
generic kernel: the whole key padded to a power of two, the values read apart from it) or ``MxNxW`` (the latent
kernel with ``BLOCK_M = M``, ``BLOCK_N = N``, ``W`` warps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from unittest import mock

import torch


def make_layout(kind: str, pool: torch.Tensor, batch: int, width: int, context: int, max_len: int):
    """A ``kind`` ("eager" or "graph") layout of ``batch`` rows, each ending at ``context`` with ``width`` new
    tokens, over shuffled blocks of ``pool [batch * max_len / block_size + 1, block_size, ...]`` (block 0: the
    scratch block)."""
    from tandem.models.attention import RaggedLayout
    from tandem.models.base import BlockTable, ForwardBatch, KVCache

    device, block_size = pool.device, pool.shape[1]
    blocks_per_row = -(-max_len // block_size)
    table = BlockTable(batch, max_len, block_size, batch * blocks_per_row + 1, device)
    order = (torch.randperm(batch * blocks_per_row, generator=torch.Generator().manual_seed(0)) + 1).tolist()
    for slot in range(batch):
        table.set_blocks(slot, order[slot * blocks_per_row : slot * blocks_per_row + -(-context // block_size)])
    if kind == "eager":
        rows = [[0] * width] * batch
        spans = ForwardBatch.from_rows(rows, [context - width] * batch, list(range(batch)), device=device)
        return RaggedLayout.build(spans, KVCache([pool], table))
    positions = torch.arange(context - width, context, device=device).repeat(batch, 1)
    write_index = torch.zeros(batch * width, dtype=torch.int64, device=device)
    return RaggedLayout.static(positions, write_index, table.sync(), 0, block_size)


def time_us(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Median microseconds per call: on CUDA the device's (CUDA-graph replays), else wall time."""
    if not cuda:
        from tandem.core.timing import median_wall_us

        return median_wall_us(fn, iters)
    import triton.testing

    fn()  # compiles the kernel and builds the layout's mask before the capture
    return triton.testing.do_bench_cudagraph(fn, rep=max(iters, 10), return_mode="median") * 1000


def latent_tiles(spec: str) -> AbstractContextManager:
    """A patch under which the kernel reads MLA's latents with ``spec``'s tiles (``--mla-tiles``)."""
    from tandem.kernels import paged_attention

    if spec == "padded":
        return mock.patch.object(paged_attention, "values_in_keys", lambda key_cache, value_cache: False)
    block_m, block_n, num_warps = map(int, spec.split("x"))
    tile_config = paged_attention.tile_config

    def tiles(*args, **kwargs) -> dict[str, int]:
        return tile_config(*args, **kwargs) | dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)

    return mock.patch.object(paged_attention, "tile_config", tiles)


def measure(layout, pool: torch.Tensor, args: argparse.Namespace) -> dict:
    """The two paths' times over ``layout`` (one query per token of its grid) and how far apart they are; with
    ``--mla-tiles``, the kernel's times with those tiles too."""
    from tandem.models import attention
    from tandem.models.deepseek_v3 import attend_latent

    cuda = pool.device.type == "cuda"
    q = torch.randn(layout.num_rows * layout.max_query, args.heads, args.head_dim, device=pool.device, dtype=pool.dtype)

    def call():
        if args.mla:
            return attend_latent(layout, q, pool, args.value_dim, args.head_dim**-0.5)
        return layout.attend(q, pool, args.head_dim**-0.5)

    row, outputs = {}, {}
    for backend, name in (("torch", "torch_us"), ("triton", "kernel_us")):
        attention.attention_backend = backend
        row[name] = round(time_us(call, args.iters, cuda), 1)
        outputs[backend] = call().float()
    row["speedup"] = round(row["torch_us"] / row["kernel_us"], 2)
    row["max_abs_diff"] = float((outputs["torch"] - outputs["triton"]).abs().max())
    for spec in args.mla_tiles:  # still the kernel's backend
        with latent_tiles(spec):
            row[f"kernel_{spec}_us"] = round(time_us(call, args.iters, cuda), 1)
            row[f"max_abs_diff_{spec}"] = float((outputs["torch"] - call().float()).abs().max())
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=4, help="drafts per verify: k + 1 queries per row")
    parser.add_argument("--max-len", type=int, default=16384, help="positions per row's table (the graph layout)")
    parser.add_argument("--layouts", nargs="+", choices=["eager", "graph"], default=["eager", "graph"])
    parser.add_argument("--prefill", type=int, default=512, help="a prefill chunk's tokens per row (eager; 0: none)")
    parser.add_argument("--iters", type=int, default=20, help="CPU: timed calls; CUDA: milliseconds of replays")
    parser.add_argument("--mla", action="store_true", help="MLA's latent cache: one head, the values its first entries")
    parser.add_argument("--value-dim", type=int, default=512, help="--mla: the latent entries that are the values")
    parser.add_argument(
        "--mla-tiles", nargs="*", default=[], metavar="TILES", help="--mla: also time these tiles (padded or MxNxW)"
    )
    args = parser.parse_args(argv)
    if args.mla_tiles and not args.mla:
        parser.error("--mla-tiles needs --mla")
    cuda = args.device.startswith("cuda")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before tandem.kernels' Triton module is imported
    from tandem.models import attention

    if max(args.contexts) > args.max_len:
        raise SystemExit(f"contexts {args.contexts} exceed --max-len {args.max_len}")
    dtype, chosen, results = getattr(torch, args.dtype), attention.attention_backend, []
    try:
        for kind in args.layouts:
            for batch in args.batch_sizes:
                pool_shape = (batch * -(-args.max_len // args.block_size) + 1, args.block_size)
                pool_shape += () if args.mla else (2, args.kv_heads)
                pool = torch.randn(*pool_shape, args.head_dim, device=args.device, dtype=dtype)
                for context in args.contexts:
                    prefill = [args.prefill] if kind == "eager" and 0 < args.prefill <= context else []
                    for width in (1, args.k + 1, *prefill):
                        layout = make_layout(kind, pool, batch, width, context, args.max_len)
                        step = {1: "decode", args.k + 1: "verify"}.get(width, "prefill")
                        row = {"layout": kind, "step": step, "batch": batch, "context": context}
                        results.append({**row, **measure(layout, pool, args)})
                        print(json.dumps(results[-1]), file=sys.stderr)
                del pool
    finally:
        attention.attention_backend = chosen
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter: not a timing)",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "heads": args.heads,
        "kv_heads": 1 if args.mla else args.kv_heads,
        "head_dim": args.head_dim,
        "mla_value_dim": args.value_dim if args.mla else None,
        "block_size": args.block_size,
        "max_len": args.max_len,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
