"""On CUDA a speculative step reads the device back once (engine docstring): the acceptance result at commit; a
chained draft's proposal stays on the device for the next verify unless host work reads it (a grammar row's walk:
then twice). Any other read, or a host-to-device copy from pageable memory, would stall the host behind the device.
Skipped without CUDA."""

import traceback
import warnings

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.llm import chat_prompt_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _device_reads(engine) -> list[str]:
    """Where one engine step synchronised with the device: each read's call stack, innermost first."""
    torch.cuda.synchronize()
    reads = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [
                f"{f.filename}:{f.lineno}"
                for f in reversed(traceback.extract_stack()[:-1])
                if not f.filename.endswith("warnings.py")
            ]
            reads.append(" <- ".join(frames[:8]))

    torch.cuda.set_sync_debug_mode("warn")  # outside the recording: torch may warn here, before the step
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return reads


# fp32 Llama; DeepSeek in bf16, where the MoE takes grouped matmuls (its fp32 loop reads group sizes)
@pytest.mark.parametrize(
    "model, draft, dtype", [("demo-llama", "eagle3", torch.float32), ("demo-deepseek", "mtp", torch.bfloat16)]
)
@pytest.mark.parametrize(
    "graph_mode, schema, batch",
    [("compiled", False, 1), ("compiled", False, 4), ("compiled", True, 4), ("eager", False, 1), ("eager", True, 1)],
)
def test_a_speculative_step_reads_the_device_once(model, draft, dtype, graph_mode, schema, batch):
    """At a fixed k (adaptive speculation may choose no drafts: test_a_step_without_drafts_reads_the_device_once).
    A schema row's step reads its drafts too, which its grammar walks: with the acceptance result when the draft
    proposes ahead of the read (compiled: CUDA's lookahead proposals), once per drafted position when it drafts
    under the grammar pass by pass (eager)."""
    llm = LLM(
        model,
        draft,
        num_speculative_tokens=4,
        device="cuda",
        dtype=dtype,
        max_num_seqs=batch,
        adaptive=False,
        graph_mode=graph_mode,
    )
    engine = llm.engine
    for example in generate_examples(batch, seed=3, split="heldout"):
        schema_ = TASK_FAMILIES[example.family].schema if schema else None
        engine.add_request(
            chat_prompt_ids(llm.tokenizer, example.messages, example.tools),
            SamplingParams(max_tokens=64, json_schema=schema_),
        )
    while len(engine.scheduler.running) < batch:  # grammars compile off the step loop; then prefills, first proposals
        engine.step()
    engine.step()  # first speculative step: allocations and caches warm
    # Schema, eagerly: the acceptance result and the proposal, and each of the k passes' tokens the walk advances by.
    expected = 1 if not schema or graph_mode == "compiled" else 2 + 4
    checked = 0
    for _ in range(3):
        reads = _device_reads(engine)
        if engine.scheduler.running:  # a step that finished every row proposes nothing
            assert len(reads) == expected, "\n".join(reads)
            checked += 1
    assert checked


def test_a_step_without_drafts_reads_the_device_once(monkeypatch):
    """When adaptive speculation gives no row a draft, the draft does not run (its next proposal takes the step's
    tokens): nothing is read back but the acceptance result."""
    llm = LLM("demo-llama", "eagle3", num_speculative_tokens=4, device="cuda", dtype=torch.float32, max_num_seqs=2)
    engine = llm.engine
    monkeypatch.setattr(engine.policy, "choose", lambda ids, pinned=None: [0] * len(ids))
    for example in generate_examples(2, seed=3, split="heldout"):
        engine.add_request(
            chat_prompt_ids(llm.tokenizer, example.messages, example.tools), SamplingParams(max_tokens=64)
        )
    for _ in range(3):
        engine.step()
    for _ in range(3):
        reads = _device_reads(engine)
        assert len(reads) == 1, "\n".join(reads)


def test_a_penalised_step_reads_the_device_once():
    """Penalties and a logit bias add no read: their tables are summed on the device from the sent ids
    (`decoding.penalties.TokenTable.dense`: scatter_add_, not index_put_ with accumulate, which may synchronise), for
    the verify and for the draft that proposes under them; a sampled row's tables add none either."""
    llm = LLM("demo-llama", "eagle3", num_speculative_tokens=4, device="cuda", dtype=torch.float32, max_num_seqs=2)
    engine = llm.engine
    penalised = [
        SamplingParams(max_tokens=64, repetition_penalty=1.3, logit_bias={11: 2.0, 12: -3.0}),
        SamplingParams(max_tokens=64, temperature=0.7, seed=5, frequency_penalty=0.4, logit_bias={13: 1.0}),
    ]
    for example, params in zip(generate_examples(2, seed=3, split="heldout"), penalised):
        engine.add_request(chat_prompt_ids(llm.tokenizer, example.messages, example.tools), params)
    for _ in range(3):  # prefill, then the first speculative steps: caches warm
        engine.step()
    for _ in range(3):
        reads = _device_reads(engine)
        assert len(reads) == 1, "\n".join(reads)


def _cudnn_kernels(run) -> list[str]:
    """The names of the cuDNN kernels that ``run()`` launched."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if "cudnn" in e.name.lower()})


@pytest.mark.parametrize("model, dtype", [("demo-llama", torch.bfloat16), ("demo-deepseek", torch.bfloat16)])
def test_eager_steps_take_no_cudnn_attention(model, dtype):
    """cuDNN's attention plans every new shape on the host (tens of milliseconds), and an eager step's key length
    grows at every step: the models' attention runs on the other backends (tandem.models.attention.sdpa)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    query = torch.randn(1, 8, 16, 64, device="cuda", dtype=dtype)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # the detector sees cuDNN's attention where it runs
        assert _cudnn_kernels(lambda: torch.nn.functional.scaled_dot_product_attention(query, query, query))
    llm = LLM(model, "mtp" if model == "demo-deepseek" else "eagle3", device="cuda", dtype=dtype, graph_mode="eager")
    example = generate_examples(1, seed=3, split="heldout")[0]
    llm.engine.add_request(
        chat_prompt_ids(llm.tokenizer, example.messages, example.tools), SamplingParams(max_tokens=32)
    )
    assert _cudnn_kernels(lambda: [llm.engine.step() for _ in range(4)]) == []


def test_graph_mode_builds_its_llama_graphs_over_cudnn_attention(monkeypatch):
    """A CUDA graph's shapes are fixed, so graph mode lets cuDNN's attention in while it warms up and captures
    (tandem.models.attention.graph_attention); its replays give the eager tokens (tests/engine/test_graphs.py).
    On the torch path: the default runs the paged-attention kernel instead of sdpa."""
    from tandem.models import attention

    monkeypatch.setattr(attention, "attention_backend", "torch")
    llm = LLM("demo-llama", device="cuda", dtype=torch.bfloat16, graph_mode="compiled", max_num_seqs=1)
    example = generate_examples(1, seed=3, split="heldout")[0]
    llm.engine.add_request(
        chat_prompt_ids(llm.tokenizer, example.messages, example.tools), SamplingParams(max_tokens=32)
    )
    assert _cudnn_kernels(lambda: [llm.engine.step() for _ in range(4)])
