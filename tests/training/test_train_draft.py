"""`train_draft` end to end on a tiny target: the trained draft is accepted more often than an untrained
one on held-out prompts, loads with `LLM(target, draft=DIR)` without changing greedy output, and stores
the reduced vocabulary as EAGLE-3 checkpoints do."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from tandem.decoding.params import SamplingParams
from tandem.llm import LLM
from tandem.models.loading import load_target
from tandem.training.checkpoint import save_draft
from tandem.training.data import DEFAULT_PROMPTS, IGNORE_INDEX, read_prompts, split_heldout
from tandem.training.trainer import DATA_FILE, DraftSettings, accepted_length, new_head, train_draft
from tandem.training.vocab import DraftVocab

SETTINGS = DraftSettings(
    steps=40, batch_size=8, warmup_steps=5, draft_vocab_size=512, max_new_tokens=48, heldout=12, save_every=0
)


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    train, heldout = split_heldout(read_prompts(DEFAULT_PROMPTS), SETTINGS.heldout, SETTINGS.seed)
    out_dir = tmp_path_factory.mktemp("draft")
    record = train_draft(tiny_target, out_dir, train[:120], heldout, SETTINGS)
    return out_dir, record, heldout


def test_training_raises_heldout_accepted_length_above_an_untrained_drafts(tiny_target, trained, tmp_path):
    out_dir, record, heldout = trained
    torch.manual_seed(SETTINGS.seed)
    target = load_target(tiny_target, dtype=torch.float32)
    vocab_ids = torch.load(out_dir / DATA_FILE, weights_only=True)["vocab_ids"]
    untrained = new_head(SETTINGS, tiny_target, target, DraftVocab(vocab_ids, target.vocab_size))
    save_draft(untrained, tmp_path, torch.float32)
    baseline = accepted_length(tiny_target, tmp_path, heldout, SETTINGS.max_new_tokens, SETTINGS.num_speculative_tokens)
    trained_length = record["heldout"]["accepted_length"]
    assert trained_length > baseline + 0.1, f"held-out accepted length {trained_length}, untrained {baseline}"
    assert record["step"] == SETTINGS.steps and len(record["train_agreement_by_depth"]) == SETTINGS.ttt_depth
    assert json.loads((out_dir / "tandem_train.json").read_text()) == record


def test_the_written_draft_loads_and_keeps_greedy_output_token_for_token(tiny_target, trained):
    out_dir, _, heldout = trained
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 512
    plain = LLM(str(tiny_target), None, max_num_seqs=4)
    speculative = LLM(str(tiny_target), str(out_dir), max_num_seqs=4)
    prompts = [plain.chat_prompt(chat.messages, chat.tools) for chat in heldout[:6]]
    params = SamplingParams(max_tokens=40)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    outputs = speculative.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.stats.accepted for o in outputs) > 0


def test_d2t_t2d_name_the_most_frequent_answer_tokens_in_target_order(tiny_target, trained):
    out_dir, _, _ = trained
    tensors = load_file(out_dir / "model.safetensors")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and d2t.shape == (512,)
    ids = torch.arange(512) + d2t
    assert (ids.diff() > 0).all() and ids.min() >= 0
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    assert tensors["lm_head.weight"].shape[0] == 512
    rows = torch.load(out_dir / DATA_FILE, weights_only=True)["rows"]
    counts = Counter(t for _, labels in rows for t in labels if t != IGNORE_INDEX)
    chosen = set(ids.tolist())
    assert min(counts[t] for t in chosen) >= max((n for t, n in counts.items() if t not in chosen), default=0)
