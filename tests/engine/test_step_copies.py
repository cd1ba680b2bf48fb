"""A replayed step crosses to the device in few copies: every host value a step needs (the verify batch, the
graph runner's plans, the drafts, the sampling tables and penalties, the draft passes' inputs) travels in one
staged copy per phase (before the verify, before the proposal; `tandem.core.transfer.Staging`), so sampled rows
copy as often as greedy ones. Counted on the CPU, where the same host code runs: each `to_device` call bound for a
device and each staging's chunk copy counts as one copy."""

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
# sampled with another seed, top-k and top-p filters, presence and frequency penalties
FILTERED = SamplingParams(
    max_tokens=200,
    ignore_eos=True,
    temperature=0.7,
    seed=11,
    top_k=20,
    top_p=0.9,
    presence_penalty=0.5,
    frequency_penalty=0.3,
)
# The bounds: one staged copy before the verify, one before the proposal, greedy or sampled (the penalties' entries
# and the sampling tables, `SamplingTensors.to(device, staging)`, travel in them), eager or compiled (the graph
# runner's plans, or the eager layouts' write indices and block tables, `RaggedLayout.stage`, too).
BOUNDS = {None: 1, "eagle3": 2}


def _started(models, draft: str | None, graph_mode: str, params: list[SamplingParams], **settings) -> Engine:
    """An engine running a row per ``params`` past its prefill and the steps that build its graphs."""
    target, draft_model, tokenizer = models("demo-llama", draft)
    config = EngineConfig(
        max_num_seqs=4, max_model_len=384, graph_mode=graph_mode, capture_sizes=(1, 2, 4), adaptive=False, **settings
    )
    engine = Engine(target, draft_model, tokenizer, config)
    prompt = chat_prompt_ids(tokenizer, EXAMPLE.messages, EXAMPLE.tools)
    for p in params:
        engine.add_request(prompt, p)
    for _ in range(3):
        engine.step()
    return engine


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_a_compiled_step_copies_to_the_device_once_per_phase(models, monkeypatch, draft, params):
    engine = _started(models, draft, "compiled", [params])
    replays = engine.runner.replays
    counts = _step_copies(monkeypatch, engine, 6)
    assert engine.runner.replays >= replays + 6  # every counted step replayed its graphs
    assert max(counts) <= BOUNDS[draft], counts


def test_a_lookahead_step_copies_to_the_device_once(models, monkeypatch):
    """A lookahead proposal's first pass is planned with the verify (`batching.Lookahead`), so its step copies once:
    greedy and seeded sampled rows (without penalties: rows with them propose after the commit)."""
    sampled = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.8, seed=3)
    engine = _started(models, "eagle3", "compiled", [GREEDY, sampled], lookahead=True)
    lookaheads = engine.lookahead_steps
    counts = _step_copies(monkeypatch, engine, 6)
    assert engine.lookahead_steps == lookaheads + 6
    assert max(counts) <= 1, counts


@pytest.mark.parametrize("params", [[SAMPLED], [GREEDY, SAMPLED, FILTERED]], ids=["1row", "3rows"])
@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_an_eager_step_copies_as_often_as_a_compiled_one(models, monkeypatch, draft, params):
    """The eager layouts' write indices and key windows' block tables (`RaggedLayout.build`: the target's and each
    draft pass's) travel in the phase's copy too. Three rows grow side by side, so their blocks interleave: no
    layout of theirs is a slice of the pool, and each needs both."""
    engine = _started(models, draft, "eager", params)
    counts = _step_copies(monkeypatch, engine, 6)
    assert max(counts) <= BOUNDS[draft], counts


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_a_batch_of_greedy_and_sampled_rows_copies_once_per_phase(models, monkeypatch, draft):
    """Rows with different seeds, filters and penalties beside a greedy one: their tables share the phase's copy."""
    engine = _started(models, draft, "compiled", [GREEDY, SAMPLED, FILTERED])
    replays = engine.runner.replays
    counts = _step_copies(monkeypatch, engine, 4)
    assert engine.runner.replays >= replays + 4
    assert max(counts) <= BOUNDS[draft], counts
