"""Drafts published only as ``pytorch_model.bin`` (single or sharded by ``pytorch_model.bin.index.json``)
load through ``torch.load(weights_only=True)`` into the same weights as their safetensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tandem.assets import ASSETS_DIR
from tandem.models import load_draft, load_target
from tandem.models.loading import WeightReader

DRAFT = ASSETS_DIR / "demo-llama-eagle3"


@pytest.fixture(scope="module")
def target():
    return load_target(ASSETS_DIR / "demo-llama")


def write_bin(path, sharded: bool) -> None:
    """The draft's config and its tensors as ``pytorch_model.bin``, or two shards with their index."""
    shutil.copy(DRAFT / "config.json", path / "config.json")
    tensors = load_file(DRAFT / "model.safetensors")
    if not sharded:
        torch.save(tensors, path / "pytorch_model.bin")
        return
    keys = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, shard_keys in shards.items():
        torch.save({key: tensors[key] for key in shard_keys}, path / name)
    weight_map = {key: name for name, shard_keys in shards.items() for key in shard_keys}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_bin_draft_loads_the_weights_of_its_safetensors(tmp_path, target, sharded):
    write_bin(tmp_path, sharded)
    assert not list(tmp_path.glob("*.safetensors"))
    reader = WeightReader(tmp_path)
    assert reader.keys() == sorted(load_file(DRAFT / "model.safetensors"))
    assert reader.shape("fc.weight") == tuple(load_file(DRAFT / "model.safetensors")["fc.weight"].shape)
    from_bin, from_safetensors = load_draft(tmp_path, target), load_draft(DRAFT, target)
    expected = dict(from_safetensors.named_parameters())
    for name, param in from_bin.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_a_bin_holding_code_is_refused(tmp_path):
    """``weights_only=True``: a pickle that would run code does not load."""
    write_bin(tmp_path, sharded=False)
    torch.save({"fc.weight": torch.ones(1), "payload": print}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="Weights only load failed"):
        WeightReader(tmp_path)
