"""The benchmark scripts' own logic: what they time and how they read a profiler trace."""

import asyncio
import copy
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch


def _script(name: str):
    """benchmarks/<name>.py as a module, loaded by path: on sys.path, a top-level `kernels` would
    pass for Hugging Face's `kernels` package, which transformers looks for."""
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
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
