"""Hub names ``org/name`` resolve through huggingface_hub's cache layout, offline (no test reaches the
network): a target and a draft published as ``pytorch_model.bin`` load from a cache built here and
decode exactly as the shipped demo pair; revisions pick their snapshot; a name found nowhere is a clear
error; a local path wins over a hub name; only the files tandem reads are asked for."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.assets import ASSETS_DIR
from tandem.llm import LLM, resolve_draft, resolve_model
from tandem.models import hub

MAIN, V1 = "a" * 40, "b" * 40  # commit hashes


def cache_repo(cache: Path, repo_id: str, source: Path, commit: str, ref: str = "main", *, as_bin=False) -> Path:
    """Put ``source``'s files into ``cache`` as huggingface_hub lays a snapshot out
    (``models--org--name/snapshots/<commit>/``, ``refs/<ref>``); ``as_bin``: weights as pytorch_model.bin."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot, ignore=shutil.ignore_patterns("*.safetensors" if as_bin else "tandem_*"))
    if as_bin:
        torch.save(load_file(source / "model.safetensors"), snapshot / "pytorch_model.bin")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local "org/..." directory shadows the names
    return cache


def test_hub_target_and_bin_draft_decode_as_the_shipped_pair(offline_cache):
    from tandem import SamplingParams

    target = cache_repo(offline_cache, "org/demo-llama", ASSETS_DIR / "demo-llama", MAIN)
    draft = cache_repo(offline_cache, "org/demo-llama-eagle3", ASSETS_DIR / "demo-llama-eagle3", MAIN, as_bin=True)
    assert not list(draft.glob("*.safetensors"))
    assert resolve_model("org/demo-llama") == target
    assert resolve_draft("org/demo-llama-eagle3", target) == draft
    hub_llm = LLM("org/demo-llama", "org/demo-llama-eagle3", num_speculative_tokens=3)
    questions = ["What is 12 plus 30?", "Classify the sentiment of this review: the lid cracked."]
    prompts = [hub_llm.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=16)
    from_hub = hub_llm.generate(prompts, params)
    shipped = LLM("demo-llama", "eagle3", num_speculative_tokens=3).generate(prompts, params)
    assert [out.token_ids for out in from_hub] == [out.token_ids for out in shipped]
    assert sum(out.stats.accepted for out in from_hub) > 0  # the draft's proposals were accepted: it loaded


def test_a_revision_picks_its_snapshot(offline_cache):
    main = cache_repo(offline_cache, "org/demo-llama", ASSETS_DIR / "demo-llama", MAIN)
    v1 = cache_repo(offline_cache, "org/demo-llama", ASSETS_DIR / "demo-llama", V1, ref="v1")
    assert resolve_model("org/demo-llama") == main
    assert resolve_model("org/demo-llama", "v1") == v1
    assert resolve_model("org/demo-llama", V1) == v1  # a commit hash


def test_a_name_in_neither_cache_nor_hub_is_a_clear_error(offline_cache):
    cache_repo(offline_cache, "org/demo-llama", ASSETS_DIR / "demo-llama", MAIN)
    reached = "not in the local cache and the hub could not be reached"
    with pytest.raises(FileNotFoundError, match=rf"model 'org/missing' \(revision 'main'\): {reached}"):
        resolve_model("org/missing")
    with pytest.raises(FileNotFoundError, match=rf"model 'org/demo-llama' \(revision 'v2'\): {reached}"):
        LLM("org/demo-llama", revision="v2")
    with pytest.raises(FileNotFoundError, match=rf"model 'org/missing-draft' \(revision 'main'\): {reached}"):
        resolve_draft("org/missing-draft", ASSETS_DIR / "demo-llama")


def test_a_local_directory_wins_over_a_hub_name(offline_cache, tmp_path):
    cache_repo(offline_cache, "org/demo-llama", ASSETS_DIR / "demo-llama", MAIN)
    local = tmp_path / "org" / "demo-llama"
    shutil.copytree(ASSETS_DIR / "demo-llama", local)
    assert resolve_model("org/demo-llama") == Path("org/demo-llama")
    assert not hub.is_hub_name("org/demo-llama")
    assert hub.is_hub_name("org/other") and not hub.is_hub_name("demo-llama") and not hub.is_hub_name("a/b/c")


def test_only_the_files_tandem_reads_are_downloaded():
    from huggingface_hub.utils import filter_repo_objects

    published = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "original/consolidated.00.pth",
        "original/params.json",
        "original/model.safetensors",
        "pytorch_model.bin",
        "README.md",
        "LICENSE",
        ".gitattributes",
    ]

    def kept(files):
        return set(filter_repo_objects(published, allow_patterns=list(files), ignore_patterns=list(hub.SKIPPED_FILES)))

    reads = {name for name in published if not name.startswith("original/")} - {"pytorch_model.bin", "README.md"}
    assert kept(hub.TARGET_FILES) == reads - {"LICENSE", ".gitattributes"}
    assert kept(hub.DRAFT_FILES) == kept(hub.TARGET_FILES) | {"pytorch_model.bin"}


def test_online_the_hub_is_asked_for_the_revision_and_its_refusal_is_named(tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE unset, huggingface_hub is asked (here a stand-in: no network in tests) and a
    gated or missing repository's message reaches the error."""
    import huggingface_hub
    from httpx2 import Request, Response
    from huggingface_hub.errors import GatedRepoError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls = []

    def refuse(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        response = Response(401, request=Request("GET", f"https://huggingface.co/api/models/{repo_id}"))
        raise GatedRepoError("Access to model org/gated is restricted: pass a token", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(FileNotFoundError, match=r"model 'org/gated' \(revision 'v1'\): Access to model org/gated"):
        resolve_model("org/gated", "v1")
    ((repo_id, kwargs),) = calls
    assert repo_id == "org/gated" and kwargs["revision"] == "v1" and kwargs["local_files_only"] is False
    assert kwargs["allow_patterns"] == list(hub.TARGET_FILES) and kwargs["ignore_patterns"] == ["original/*"]
