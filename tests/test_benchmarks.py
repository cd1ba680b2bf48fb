"""The benchmark scripts' own logic: what they time and how they read a profiler trace."""

import asyncio
import copy
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import pytest


def _script(name: str):
    """benchmarks/<name>.py as a module, loaded by path: on sys.path, a top-level `kernels` would
    pass for Hugging Face's `kernels` package, which transformers looks for."""
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


kernels, overlap = _script("kernels"), _script("overlap")


def test_the_torch_backend_times_the_torch_path_even_for_cuda_tensors():
    case = kernels.make_case("masked", 2, 4, 64, "cpu")
    with patch.object(kernels, "accept", wraps=kernels.accept) as accept:
        kernels.backend_call("torch", case)()
        kernels.backend_call("xgrammar+torch", case)()
    assert [call.kwargs["backend"] for call in accept.call_args_list] == ["torch", "torch"]


def _event(cat, ts, dur, stream, name="k"):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}


def test_trace_summary_counts_copy_time_hidden_behind_other_streams_kernels():
    trace = {
        "traceEvents": [
            _event("kernel", 0, 10, 7),
            _event("kernel", 20, 10, 7),  # the target on stream 7
            _event("gpu_memcpy", 5, 10, 13, "Memcpy HtoD (Pinned -> Device)"),  # 5 of 10 us under kernels
            _event("gpu_memcpy", 40, 4, 7, "Memcpy HtoD (Pinned -> Device)"),  # same stream: never hidden
            _event("gpu_memcpy", 30, 2, 13, "Memcpy DtoH (Device -> Pinned)"),  # not a host-to-device copy
            {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100, "name": "aten::mm", "args": {}},
        ]
    }
    summary = overlap.trace_summary(trace)
    assert summary["kernels"] == 2 and summary["window_us"] == 44
    assert summary["device_busy_fraction"] == round(20 / 44, 3)
    assert summary["htod_copies_by_stream"] == {
        "13": {"copies": 1, "copy_us": 10, "overlapped_fraction": 0.5},
        "7": {"copies": 1, "copy_us": 4, "overlapped_fraction": 0.0},
    }
    assert overlap.trace_summary({"traceEvents": []}) == {"kernels": 0}
    trace["traceEvents"].append(_event("kernel", 50, 3, 7, "rms_norm"))
    assert overlap.trace_summary(trace, top=1)["top_kernels"] == {"k": [2, 20.0]}  # the heaviest by time


class _RecordingClient:
    """An AsyncOpenAI stand-in: records each request and streams a schema-valid answer."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request):
        self.requests.append(copy.deepcopy(request))  # the agent appends to its messages afterwards

        async def stream():
            delta = SimpleNamespace(content='{"summary": "done"}', tool_calls=None)
            yield SimpleNamespace(usage=None, choices=[SimpleNamespace(delta=delta, finish_reason="stop")])
            yield SimpleNamespace(usage=SimpleNamespace(prompt_tokens=9, completion_tokens=5), choices=[])

        return stream()


def test_each_agent_turn_resends_the_conversation_so_far_plus_a_new_user_message():
    serve_load = _script("serve_load")
    (conversation,) = serve_load.agent_conversations(requests=3, turns=3)
    client, results = _RecordingClient(), []
    asyncio.run(conversation(client, results))
    assert [r["error"] for r in results] == [None, None, None]
    sent = [request["messages"] for request in client.requests]
    assert sent[0][0] == {"role": "system", "content": serve_load.AGENT_SYSTEM}
    for before, after in zip(sent, sent[1:]):
        assert after[: len(before)] == before  # the shared prefix
        assert [m["role"] for m in after[len(before) :]] == ["assistant", "user"]
    assert all(request["tools"] == serve_load.AGENT_TOOLS for request in client.requests)


BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def test_graph_steps_times_rows_that_run_through_eos_and_leaves_the_engine_empty(monkeypatch):
    from tandem import LLM

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # graph_steps imports overlap
    graph_steps = _script("graph_steps")
    llm = LLM("demo-llama", device="cpu", graph_mode="eager", max_num_seqs=2)
    prompt = llm.chat_prompt([{"role": "user", "content": "What is 12 plus 30?"}])
    row = graph_steps.measure_case(llm.engine, [prompt, prompt], SimpleNamespace(warmup=2, steps=40, k=0))
    assert row["tokens_per_step"] == 2.0 and "device_ms" not in row  # no row ended: one token each per step
    assert not llm.engine.has_unfinished()
    rates = [("plain", "eager", 10), ("plain", "compiled", 20), ("eagle3", "eager", 25), ("eagle3", "compiled", 60)]
    cases = [{"model": "m", "draft": d, "graph_mode": g, "batch": 1, "tokens_per_s": r} for d, g, r in rates]
    for draft, rate in (("plain-async", 30), ("eagle3-after-commit", 48)):
        cases.append({"model": "m", "draft": draft, "graph_mode": "compiled", "batch": 1, "tokens_per_s": rate})
    ratios = {(r.get("draft"), r.get("graph_mode")): r for r in graph_steps._ratios(cases)}
    assert ratios[None, "compiled"]["async_over_sync"] == 1.5
    assert ratios["eagle3-after-commit", "compiled"]["lookahead_over_commit"] == 1.25
    assert ratios["eagle3", "eager"]["speculative_over_plain"] == 2.5
    assert ratios["eagle3", "compiled"]["speculative_over_plain"] == 3.0
    assert ratios["eagle3", None]["compiled_over_eager"] == 2.4 and ratios["plain", None]["compiled_over_eager"] == 2.0


@pytest.mark.parametrize("schema", ["", "--schema --max-tokens 24"], ids=["free", "schema"])
def test_the_async_scheduling_benchmark_interleaves_both_engines_over_the_same_tokens(capsys, schema):
    import json

    benchmark = _script("async_scheduling")
    argv = (
        f"--device cpu --dtype float32 --models demo-llama --batch 2 --graph-mode eager --rounds 2 --steps 6 {schema}"
    )
    assert benchmark.main(argv.split()) == 0
    (case,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cases"]
    assert case["exact"] and case["schema"] == bool(schema) and case["async"]["read_wait_ms"] >= 0
    assert case["async_over_sync"] == round(case["async"]["tokens_per_s"] / case["sync"]["tokens_per_s"], 3)


def test_the_lookahead_benchmark_interleaves_both_engines_over_the_same_tokens(monkeypatch, capsys):
    """`--setting lookahead`: the target with its draft, lookahead proposals off and on (graph mode; dynamo's eager
    backend keeps the compiles short)."""
    import json

    monkeypatch.setenv("TANDEM_COMPILE_BACKEND", "eager")
    benchmark = _script("async_scheduling")
    argv = "--device cpu --dtype float32 --models demo-llama --batch 2 --rounds 2 --steps 4 --setting lookahead"
    assert benchmark.main(argv.split()) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (case,) = report["cases"]
    assert report["benchmark"] == "lookahead" and case["exact"] and "read_wait_ms" not in case["lookahead"]
    ratio = case["lookahead"]["tokens_per_s"] / case["after_commit"]["tokens_per_s"]
    assert case["lookahead_over_commit"] == round(ratio, 3)


def test_the_adaptive_benchmark_reports_each_case_and_what_the_policy_chose(monkeypatch, capsys):
    import json

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    adaptive = _script("adaptive")
    argv = "--models demo-llama --device cpu --graph-mode eager --prompts 1 --max-tokens 12 --repeats 1"
    assert adaptive.main(argv.split()) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"]["demo-llama+eagle3"]
    assert rows["plain"]["tokens_per_step"] == 1.0 and rows["fixed"]["tokens_per_step"] > 1.0
    assert all(rows[case]["over_plain"] > 0 for case in ("adaptive", "fixed"))
    policy = rows["adaptive"]
    assert sum(policy["chosen"].values()) > 0 and 1 in map(int, policy["verify_ms"])
    assert policy["step_ms_by_drafts"] and all(ms > 0 for ms in policy["step_ms_by_drafts"].values())
    assert all(rows[case]["step_ms"] > 0 for case in ("plain", "adaptive", "fixed"))


def test_the_large_target_benchmark_hands_tandem_the_transformers_weights(monkeypatch):
    import torch

    from tandem.models import ForwardBatch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    large_target = _script("large_target")
    shape = SimpleNamespace(device="cpu", vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
    model = large_target.hf_model(shape, torch.float32)
    target = large_target.tandem_target(model)
    ids = torch.randint(512, (12,), generator=torch.Generator().manual_seed(0))
    expected = model(ids[None]).logits[0]
    out = target.forward(ForwardBatch.from_rows([ids.tolist()], [0], [0]), target.new_cache(1, 16))
    torch.testing.assert_close(out.logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention_kind", ["", "--mla --head-dim 40 --value-dim 32"], ids=["kv", "mla"])
def test_the_paged_attention_benchmark_times_both_paths_in_both_layouts_at_tiny_shapes(capsys, attention_kind):
    import json

    import torch

    from tandem.models import attention

    paged_attention = _script("paged_attention")
    chosen = attention.attention_backend
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU's kernel: Triton's interpreter
    tiny = "--heads 4 --kv-heads 2 --head-dim 16 --contexts 40 --batch-sizes 2 --max-len 64 --iters 1"
    assert paged_attention.main([*tiny.split(), *attention_kind.split(), "--device", device, "--dtype", "float32"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    cases = [(layout, step) for layout in ("eager", "graph") for step in ("decode", "verify")]
    assert [(r["layout"], r["step"]) for r in rows] == cases
    assert all(r["torch_us"] > 0 and r["kernel_us"] > 0 and r["max_abs_diff"] < 1e-5 for r in rows)
    assert attention.attention_backend == chosen


def test_the_paper_plan_counts_the_mtp_layer_split_with_the_target():
    """On the demo DeepSeek-V3's shapes, widened: the MTP layer each of 2 ranks holds is about half the whole one's (its
    norms and projection stay whole), and a chained draft pass sends the all-reduces of its layer on 2 ranks
    only."""
    import json

    from tandem.models.config import DeepseekV3Config
    from tandem.models.deepseek_v3 import DeepseekV3
    from tandem.models.parallel import Shard

    plan = _script("parallel_plan").plan
    raw = json.loads((Path(__file__).parents[1] / "tandem/assets/demo-deepseek/config.json").read_text())
    raw |= {"hidden_size": 3072, "moe_intermediate_size": 2048, "num_hidden_layers": 2}  # GBs to 3 decimals
    whole = plan("demo", DeepseekV3, DeepseekV3Config, raw, Shard(0, 1), [1], 2)["rank0"]
    split = plan(
        "demo",
        DeepseekV3,
        DeepseekV3Config,
        raw,
        Shard(0, 2, data_parallel_attention=True, expert_parallel=True),
        [1],
        2,
    )["other_ranks"]
    assert 0.4 * whole["mtp_weight_gb"] < split["mtp_weight_gb"] < 0.7 * whole["mtp_weight_gb"]
    assert whole["mtp_pass_batch1_sent_kb"] == 0 < split["mtp_pass_batch1_sent_kb"]


def test_the_cpu_kernels_benchmark_times_each_path_over_a_forwards_layers_and_restores_the_switches():
    from tandem.kernels import cpu_attention, cpu_linear, cpu_norm
    from tandem.models import attention

    cpu_kernels = _script("cpu_kernels")
    built, backend = cpu_norm.available(), attention.attention_backend
    result = cpu_kernels.bench_model("demo-llama", [1, 40], repeats=1, context=24)
    row = result["rows_1"]
    assert result["linears"] == 16 * 4 + 1 and result["norms"] == 16 * 2 + 1  # each layer's, and the head's
    assert row["f_linear_us"] > 0 and row["norm_torch_us"] > 0 and row["forward_torch_attention_us"] > 0
    assert ("kernel_us" in row and "kernel_hot_us" in row) == cpu_linear.available()
    assert ("norm_kernel_us" in row) == built and cpu_norm.available() == built
    assert ("forward_kernel_attention_us" in row) == cpu_attention.available()
    assert "forward_torch_attention_us" not in result["rows_40"]  # a prefill-sized step keeps sdpa either way
    assert attention.attention_backend == backend
