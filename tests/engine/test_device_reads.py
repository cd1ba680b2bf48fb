"""On CUDA a speculative step reads the device back exactly twice (engine docstring): the
acceptance result at commit and the drafts after propose. Any other read, or a host-to-device
copy from pageable memory, would stall the host behind the device. Skipped without CUDA."""

import warnings

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.demo.corpus import generate_examples
from tandem.llm import chat_prompt_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _device_reads(engine) -> list[str]:
    """Where one engine step synchronised with the device (file:line of each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


# fp32 Llama; DeepSeek in bf16, where the MoE takes grouped matmuls (its fp32 loop reads group sizes)
@pytest.mark.parametrize("model, draft, dtype", [("demo-llama", "eagle3", torch.float32),
                                                 ("demo-deepseek", "mtp", torch.bfloat16)])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_speculative_step_reads_the_device_twice(model, draft, dtype, batch):
    llm = LLM(model, draft, num_speculative_tokens=4, device="cuda", dtype=dtype, max_num_seqs=batch)
    engine = llm.engine
    for example in generate_examples(batch, seed=3, split="heldout"):
        engine.add_request(chat_prompt_ids(llm.tokenizer, example.messages, example.tools), SamplingParams(max_tokens=64))
    engine.step()  # prefill and first proposals
    engine.step()  # first speculative step: allocations and caches warm
    for _ in range(3):
        reads = _device_reads(engine)
        assert len(reads) == 2, reads
