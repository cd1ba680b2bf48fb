"""The EOS list of a model's generation_config.json (an int or a list, as published): every id in it
ends a request, the tokenizer's EOS too, plain and speculative."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from tandem import LLM, SamplingParams
from tandem.assets import ASSETS_DIR
from tandem.engine.stop import eos_ids
from tandem.models.loading import generation_eos_ids

QUESTION = [{"role": "user", "content": "What is 12 plus 30?"}]


@pytest.mark.parametrize("eos, expected", [(4, (4,)), ([128001, 128008, 128009], (128001, 128008, 128009)), (None, ())])
def test_generation_config_eos_is_read_as_an_int_or_a_list(tmp_path, eos, expected):
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": eos}))
    assert generation_eos_ids(tmp_path) == expected
    assert generation_eos_ids(tmp_path / "nowhere") == ()


def test_eos_ids_are_the_tokenizers_and_the_generation_configs():
    assert eos_ids(SimpleNamespace(eos_token_id=2), (128008, 128009)) == {2, 128008, 128009}
    assert eos_ids(SimpleNamespace(eos_token_id=None), (7,)) == {7}


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_the_second_generation_config_eos_ends_generation(tmp_path, draft):
    params = SamplingParams(max_tokens=40)
    plain = LLM("demo-llama", draft, num_speculative_tokens=3)
    baseline = plain.generate([plain.chat_prompt(QUESTION)], params)[0].token_ids
    tokenizer_eos = plain.tokenizer.eos_token_id
    cut = next(i for i, token in enumerate(baseline) if i >= 3 and token != tokenizer_eos)
    stop_token = baseline[cut]
    model = tmp_path / "llama-two-eos"
    shutil.copytree(ASSETS_DIR / "demo-llama", model)
    shutil.copytree(ASSETS_DIR / "demo-llama-eagle3", tmp_path / "llama-two-eos-eagle3")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [tokenizer_eos, stop_token]}))

    out = LLM(str(model), draft, num_speculative_tokens=3).generate([plain.chat_prompt(QUESTION)], params)[0]
    assert out.token_ids == baseline[: baseline.index(stop_token) + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_ignore_eos_runs_to_max_tokens_through_the_eos(draft):
    """The answer that stopped at EOS goes on: the same tokens, the EOS, then more until max_tokens."""
    llm = LLM("demo-llama", draft, num_speculative_tokens=3)
    prompt = llm.chat_prompt(QUESTION)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=200))[0]
    assert stopped.finish_reason == "stop"
    through = llm.generate([prompt], SamplingParams(max_tokens=len(stopped.token_ids) + 12, ignore_eos=True))[0]
    assert through.finish_reason == "length" and len(through.token_ids) == len(stopped.token_ids) + 12
    assert through.token_ids[: len(stopped.token_ids)] == stopped.token_ids


def test_ignore_eos_is_refused_with_a_constraint():
    with pytest.raises(ValueError, match="ignore_eos: a constrained answer ends at EOS; drop it or regex"):
        SamplingParams(regex="a+", ignore_eos=True)
