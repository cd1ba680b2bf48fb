"""Graph mode's compile cache: importing tandem leaves the environment alone; building a graph runner points
inductor at ``~/.cache/tandem/inductor`` (``tandem.engine.graphs.CACHE_DIR``) unless the user chose a directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.engine.graphs import CACHE_DIR, GraphRunner

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def test_importing_tandem_sets_no_compile_cache():
    code = f"import os, tandem.llm, tandem.engine.graphs; print(os.environ.get({CACHE_ENV!r}))"
    env = {name: value for name, value in os.environ.items() if name != CACHE_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("chosen", [None, "user"])
def test_a_graph_runner_sets_the_compile_cache_unless_the_user_did(llama_target, monkeypatch, tmp_path, chosen):
    if chosen is None:
        monkeypatch.delenv(CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / chosen))
    cache = llama_target.new_cache(1 + GraphRunner.SCRATCH_SLOTS, 32)
    GraphRunner(llama_target, cache, widths=(1,), capture_sizes=(1,), backend="aot_eager")
    assert os.environ[CACHE_ENV] == (str(CACHE_DIR) if chosen is None else str(tmp_path / chosen))
