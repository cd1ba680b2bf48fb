"""Every target/draft pair on the shipped demo models, fp32: speculative greedy output equals plain
greedy output token for token, log-probabilities included (batch 1 and 8, with and without a JSON
schema), the trained drafts are actually accepted, and `</think>` inside an accepted draft run splits
reasoning and answer right."""

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from tandem.assets import ASSETS_DIR
from tandem.core.bitmask import token_allowed
from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.engine import engine as engine_module
from tandem.llm import LLM
from tests.engine.test_logprobs import assert_same_logprobs
from tests.models.test_eagle3 import write_eagle3

EXAMPLES = generate_examples(8, seed=11, split="heldout")
MAX_TOKENS = 64
# (target, draft): every shipped draft, the model-free baseline, and an EAGLE-3 draft (random weights)
# next to the MLA + MoE target, as the Kimi-K2.5 drafts are.
PAIRS = [
    ("demo-llama", "eagle3"),
    ("demo-llama", "eagle"),
    ("demo-llama", "ngram"),
    ("demo-deepseek", "mtp"),
    ("demo-deepseek", "ngram"),
    ("demo-deepseek", "random-eagle3"),
]
TRAINED = {("demo-llama", "eagle3"), ("demo-llama", "eagle"), ("demo-deepseek", "mtp")}


@pytest.fixture(scope="module")
def random_eagle3(tmp_path_factory):
    """An EAGLE-3 checkpoint for demo-deepseek (its hidden size and vocab, reduced draft vocab with d2t)."""
    path = tmp_path_factory.mktemp("eagle3-for-deepseek")
    config = json.loads((ASSETS_DIR / "demo-deepseek" / "config.json").read_text())
    write_eagle3(
        path,
        hidden=config["hidden_size"],
        inter=384,
        vocab=config["vocab_size"],
        draft_vocab=1024,
        arch="Eagle3DeepseekV2ForCausalLM",
    )
    return path


@pytest.fixture(scope="module")
def llms(random_eagle3):
    """LLM instances by (model, draft), built on first use, fp32."""
    cache: dict[tuple[str, str | None], LLM] = {}

    def get(model: str, draft: str | None) -> LLM:
        if (model, draft) not in cache:
            path = str(random_eagle3) if draft == "random-eagle3" else draft
            cache[model, draft] = LLM(model, path, num_speculative_tokens=4, dtype=torch.float32, max_num_seqs=8)
        return cache[model, draft]

    return get


def generate(llm: LLM, batch: int, schema: bool, adjustments: list[dict] | None = None):
    """Greedy outputs for EXAMPLES, `batch` requests at a time (batch 1: the first three, to save time);
    example i also gets the SamplingParams fields `adjustments[i % len(adjustments)]`."""
    engine, outputs, examples = llm.engine, [], EXAMPLES if batch > 1 else EXAMPLES[:3]
    adjustments = adjustments or [{}]
    for first in range(0, len(examples), batch):
        ids = []
        for i, example in enumerate(examples[first : first + batch], start=first):
            params = SamplingParams(
                max_tokens=MAX_TOKENS,
                logprobs=1,
                **adjustments[i % len(adjustments)],
                json_schema=TASK_FAMILIES[example.family].schema if schema else None,
            )
            ids.append(engine.add_request(llm.chat_prompt(example.messages, example.tools), params))
        while engine.has_unfinished():
            engine.step()
        outputs.extend(engine.pop_finished(i) for i in ids)
    return outputs


@pytest.mark.parametrize("schema", [False, True], ids=["free", "schema"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_speculative_greedy_equals_plain_greedy_token_for_token(llms, pair, batch, schema):
    model, draft = pair
    plain = generate(llms(model, None), batch, schema)
    speculative = generate(llms(model, draft), batch, schema)
    assert_same_logprobs(speculative, plain)  # same tokens, and their log-probabilities
    assert sum(o.stats.drafted for o in speculative) > 0
    if schema:
        for example, output in zip(EXAMPLES, speculative):
            if output.finish_reason == "stop":
                jsonschema.validate(json.loads(output.text), TASK_FAMILIES[example.family].schema)


# Both demo models share the tokenizer; the biased tokens are ones their answers use.
_TOKEN = AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer").convert_tokens_to_ids
PENALTIES = [
    {"frequency_penalty": 0.8},
    {"repetition_penalty": 1.3},
    {},
    {"presence_penalty": 1.5, "logit_bias": {_TOKEN("positive"): 4.0, _TOKEN('"}'): -100.0}},
]


@pytest.mark.parametrize("schema", [False, True], ids=["free", "schema"])
@pytest.mark.parametrize("pair", sorted(TRAINED), ids=["+".join(p) for p in sorted(TRAINED)])
def test_speculative_greedy_equals_plain_greedy_with_penalties_and_logit_bias(llms, pair, schema):
    """Each verify position counts the drafts before it as output: speculation changes nothing, while the
    penalties do change what is generated."""
    model, draft = pair
    plain = generate(llms(model, None), 8, schema, PENALTIES)
    speculative = generate(llms(model, draft), 8, schema, PENALTIES)
    assert_same_logprobs(speculative, plain)
    assert sum(o.stats.accepted for o in speculative) > 0
    unadjusted = generate(llms(model, None), 8, schema)
    changed = [a.token_ids != b.token_ids for a, b in zip(plain, unadjusted)]
    # Half of the six penalised rows at least (a schema with json.dumps separators leaves them little to move).
    assert not any(changed[2::4]) and sum(changed) >= 3, changed
    for example, output in zip(EXAMPLES, speculative):
        if schema and output.finish_reason == "stop":
            jsonschema.validate(json.loads(output.text), TASK_FAMILIES[example.family].schema)


@pytest.mark.parametrize("pair", sorted(TRAINED), ids=["+".join(p) for p in sorted(TRAINED)])
def test_drafts_choose_with_their_rows_penalties_and_biases(llms, pair):
    """A bias that makes the target repeat one token: drafts that apply the row's adjustments propose it
    every time, and every draft is accepted; the unbiased rows beside them draft as usual."""
    favoured = _TOKEN("positive")
    outputs = generate(llms(*pair), 8, False, [{"logit_bias": {favoured: 100.0}}, {}])
    for biased in outputs[0::2]:
        assert set(biased.token_ids) == {favoured}
        assert biased.stats.accepted == biased.stats.drafted > 0
    assert all(favoured not in output.token_ids[:4] for output in outputs[1::2])


@pytest.mark.parametrize("pair", sorted(TRAINED), ids=["+".join(p) for p in sorted(TRAINED)])
def test_the_shipped_drafts_are_trained(llms, pair, monkeypatch):
    """An untrained head is accepted about 0 times per step; the shipped ones most of the time. This
    measures the drafts at a fixed k, so adaptive speculation (which may verify fewer) is off."""
    llm = llms(*pair)
    monkeypatch.setattr(llm.engine.config, "adaptive", False)
    outputs = generate(llm, 8, False)
    steps = sum(o.stats.steps for o in outputs)
    accepted = sum(o.stats.accepted for o in outputs)
    assert (accepted + steps) / steps >= 2.5, f"mean accepted length {(accepted + steps) / steps:.2f}"


@pytest.mark.parametrize("pair", sorted(TRAINED), ids=["+".join(p) for p in sorted(TRAINED)])
def test_drafts_follow_the_grammar(llms, pair, monkeypatch):
    """Grammar-aware drafting: no draft is rejected for being forbidden where the grammar allows something. Rows
    keep all k drafts (adaptive speculation off: its choices follow the machine's timings, and a loaded machine's
    could leave too few drafts to check)."""
    llm = llms(*pair)  # built (its cost calibration accepts without masks) before the spy is in place
    monkeypatch.setattr(llm.engine.config, "adaptive", False)
    checked, forbidden = 0, 0
    real_accept = engine_module.accept

    def spy(logits, drafts, **options):
        nonlocal checked, forbidden
        result = real_accept(logits, drafts, **options)
        for b, n in enumerate(result.num_accepted.tolist()):  # n: the first rejected draft
            row = options["bitmask"][b, n]
            if n < drafts.shape[1] and drafts[b, n] >= 0 and row.any():
                checked += 1
                forbidden += not bool(token_allowed(row[None], drafts[b, n][None]))
        return result

    monkeypatch.setattr(engine_module, "accept", spy)
    generate(llm, 8, True)
    assert checked > 0 and forbidden == 0, f"{forbidden} of {checked} rejected drafts were forbidden"


@pytest.mark.parametrize("pair", sorted(TRAINED), ids=["+".join(p) for p in sorted(TRAINED)])
def test_verify_masks_come_from_the_draft_walk_and_equal_a_fresh_fill(llms, pair, monkeypatch):
    """A step whose rows all verify the drafts their grammar walk went through takes its masks from
    that walk (no pipeline job); they equal, bit for bit, what `fill` builds from scratch at every position
    a row verifies (past its drafts a row's masks are never read). Rows keep all k drafts here (adaptive
    speculation off): a row that keeps fewer takes its masks from the pipeline."""
    engine = llms(*pair).engine
    monkeypatch.setattr(engine.config, "adaptive", False)
    submit_masks, submit_job = engine.step_masks.submit, engine.mask_pipeline.submit
    reused, jobs = 0, 0

    def checked_masks(rows, drafts):
        nonlocal reused
        masks = submit_masks(rows, drafts)
        if masks is not None and all(r.walked_masks is not None for r in rows):
            reused += 1
            bitmask, in_thinking = (mask.cpu() for mask in masks[0].wait()[:2])  # `fill` writes host buffers
            fresh_bitmask, fresh_thinking = torch.zeros_like(bitmask), torch.zeros_like(in_thinking)
            engine.masker.fill([r.request_id for r in rows], drafts, fresh_bitmask, fresh_thinking)
            for b, r in enumerate(rows):  # the positions row b verifies: its drafts and the one after them
                used = slice(0, len(r.drafts) + 1)
                assert torch.equal(bitmask[b, used], fresh_bitmask[b, used])
                assert torch.equal(in_thinking[b, used], fresh_thinking[b, used])
        return masks

    def counted_job(*args):
        nonlocal jobs
        jobs += 1
        return submit_job(*args)

    monkeypatch.setattr(engine.step_masks, "submit", checked_masks)
    monkeypatch.setattr(engine.mask_pipeline, "submit", counted_job)
    generate(llms(*pair), 8, True)
    assert reused > 3 * jobs > 0, (reused, jobs)  # jobs: the prefill, and steps whose drafts were cut


def test_think_end_inside_an_accepted_draft_run_splits_reasoning_and_answer(llms, monkeypatch):
    llm = llms("demo-llama", "eagle3")
    close = llm.tokenizer.convert_tokens_to_ids("</think>")
    engine = llm.engine
    monkeypatch.setattr(engine.config, "adaptive", False)  # the check needs whole k-draft runs accepted
    ids = [
        engine.add_request(llm.chat_prompt(ex.messages, ex.tools), SamplingParams(max_tokens=MAX_TOKENS))
        for ex in EXAMPLES
    ]
    mid_run = 0
    while engine.has_unfinished():
        for delta in engine.step():
            if close in delta.token_ids[1:-1]:  # one step committed reasoning, `</think>` and answer tokens
                mid_run += 1
                assert delta.reasoning and delta.text
    assert mid_run > 0, "no step accepted a run across </think>: the check did not run"

    def decode(token_ids):
        return llm.tokenizer.decode(token_ids, skip_special_tokens=True)

    for request_id in ids:
        out = engine.pop_finished(request_id)
        cut = out.token_ids.index(close) if close in out.token_ids else len(out.token_ids)
        assert (out.reasoning, out.text) == (decode(out.token_ids[:cut]), decode(out.token_ids[cut + 1 :]))
