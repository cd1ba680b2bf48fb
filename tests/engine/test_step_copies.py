"""A replayed step crosses to the device in few copies: every host value a step needs (the verify batch, the
graph runner's plans, the drafts, the draft passes' inputs) travels in one staged copy per phase (before the
verify, before the proposal; `tandem.core.transfer.Staging`). Counted on the CPU, where the same host code runs:
each `to_device` call bound for a device and each staging's chunk copy counts as one copy."""

from __future__ import annotations

import sys

import pytest

from tandem.core import transfer
from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import generate_examples
from tandem.engine.engine import Engine, EngineConfig
from tandem.llm import chat_prompt_ids

EXAMPLE = generate_examples(1, seed=5, split="heldout")[0]


@pytest.fixture(autouse=True)
def _dynamo_only(monkeypatch):
    monkeypatch.setenv("TANDEM_COMPILE_BACKEND", "eager")


def _copy_counter(monkeypatch) -> list[str]:
    """Patch every host-to-device copy path; returns the list each copy appends its kind to."""
    copies: list[str] = []
    original = transfer.to_device

    def to_device(host, device):
        if device is not None:
            copies.append("to_device")
        return original(host, device)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("tandem") and getattr(module, "to_device", None) is original:
            monkeypatch.setattr(module, "to_device", to_device)
    send = transfer.Staging.send

    def staged_send(staging):
        copies.extend(["staging"] * staging.num_copies)
        return send(staging)

    monkeypatch.setattr(transfer.Staging, "send", staged_send)
    return copies


def _step_copies(monkeypatch, engine: Engine, steps: int) -> list[int]:
    copies = _copy_counter(monkeypatch)
    counts = []
    for _ in range(steps):
        before = len(copies)
        engine.step()
        counts.append(len(copies) - before)
    return counts


GREEDY = SamplingParams(max_tokens=200, ignore_eos=True)
# sampled, with penalties and a logit bias: the sampling tables and the adjustments' entries travel too
SAMPLED = SamplingParams(
    max_tokens=200, ignore_eos=True, temperature=0.8, seed=3, repetition_penalty=1.2, logit_bias={7: 1.5, 9: -2.0}
)


# The bounds: one staged copy before the verify, one before the proposal (the penalties' entries in them); a
# sampled row adds its sampling tables (SamplingTensors.to: one copy per field).
@pytest.mark.parametrize(
    "draft, params, bound", [(None, GREEDY, 1), ("eagle3", GREEDY, 2), (None, SAMPLED, 6), ("eagle3", SAMPLED, 7)]
)
def test_a_compiled_step_copies_to_the_device_a_few_times(models, monkeypatch, draft, params, bound):
    target, draft_model, tokenizer = models("demo-llama", draft)
    config = EngineConfig(max_num_seqs=1, max_model_len=384, graph_mode="compiled", capture_sizes=(1,), adaptive=False)
    engine = Engine(target, draft_model, tokenizer, config)
    prompt = chat_prompt_ids(tokenizer, EXAMPLE.messages, EXAMPLE.tools)
    engine.add_request(prompt, params)
    for _ in range(3):  # prefill, then the steps that build the graphs
        engine.step()
    replays = engine.runner.replays
    counts = _step_copies(monkeypatch, engine, 6)
    assert engine.runner.replays >= replays + 6  # every counted step replayed its graphs
    assert max(counts) <= bound, counts
