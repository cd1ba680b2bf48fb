#!/usr/bin/env bash
# What only a GPU shows, in one run of under 10 minutes (s51, an H200: 515 s for all parts): the GPU tests
# (`pytest -m gpu`), the Llama-3.1-8B-shaped target in graph mode against the memory roofline and transformers,
# with graphs over eager kernels and over inductor's, with and without async scheduling (benchmarks/large_target.py;
# the paged-attention kernel, s41 measured the others; eager steps are bound by the host, s48 measured them), the
# paged-attention kernel against gather + sdpa for Llama's heads and MLA's latent (benchmarks/paged_attention.py),
# graph mode's step times on both demo targets, plain with async scheduling too, speculative with and without
# lookahead proposals (benchmarks/graph_steps.py; eager
# steps are bound by the host, 10-20x their device time in s39's run), plain decoding with and without async
# scheduling interleaved in one process, free and under JSON schemas, and speculative decoding with and without
# lookahead proposals the same way (benchmarks/async_scheduling.py), what adaptive
# speculation chooses (benchmarks/adaptive.py), and speculative vs plain decoding on the demo prompts in graph mode
# (`tandem bench`); all parts by default. Each part has its own time limit, so one that hangs leaves the others their time; each
# writes its log to $OUT (default ./gpu-out) and prints its exit status and last lines.
#
#   bash benchmarks/gpu.sh [part ...]  # parts: tests large_target paged_attention paged_latent graph_steps async
#                                      #        async_schema lookahead adaptive bench
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/tandem-inductor}

part() {  # part NAME SECONDS COMMAND...: run COMMAND under a time limit, its output in $out/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "   rc=$? in $((SECONDS - start))s"
    tail -n 4 "$out/$name.log" | cut -c1-1500
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
parts=${*:-tests large_target paged_attention paged_latent graph_steps async async_schema lookahead adaptive bench}
for name in $parts; do
    case $name in
    tests) part tests 210 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/engine/test_graphs.py \
        tests/engine/test_device_reads.py tests/grammars/test_mask_pipeline.py tests/core/test_transfer.py ;;
    graph_steps) part graph_steps 150 python3 benchmarks/graph_steps.py --graph-mode compiled --steps 24 --warmup 24 \
        --async-scheduling --lookahead --host-profile "$out/host_profile.txt" ;;
    large_target) part large_target 160 python3 benchmarks/large_target.py --attention triton --graph-mode compiled ;;
    adaptive) part adaptive 90 python3 benchmarks/adaptive.py --device cuda --dtype bfloat16 --graph-mode compiled ;;
    bench) part bench 180 python3 -m tandem.cli bench --device cuda --dtype bfloat16 --graph-mode compiled \
        --drafts eagle3 mtp --k 4 --batch 1 --prompts 4 --max-tokens 64 --repeats 2 --json --progress on ;;
    async) part async 90 python3 benchmarks/async_scheduling.py ;;
    async_schema) part async_schema 120 python3 benchmarks/async_scheduling.py --schema ;;
    lookahead) part lookahead 120 python3 benchmarks/async_scheduling.py --setting lookahead ;;
    paged_attention) part paged_attention 70 python3 benchmarks/paged_attention.py ;;
    paged_latent) part paged_latent 100 python3 benchmarks/paged_attention.py --mla --heads 128 --head-dim 576 \
        --value-dim 512 --contexts 4096 16384 --prefill 0 --mla-tiles padded 64x32x8 ;;
    *) echo "unknown part $name" ;;
    esac
done
