"""`--graph-mode`, `--adaptive`, `--async-scheduling` and `--lookahead` reach `tandem.LLM` from the commands that
build one (the model is not loaded)."""

from __future__ import annotations

import pytest

from tandem.cli import main


class Built(Exception):
    """Raised by the stand-in LLM once it has the command's arguments."""


@pytest.fixture
def llm_kwargs(monkeypatch) -> list[dict]:
    """Every `LLM(...)` call's keyword arguments; the call stops the command."""
    calls: list[dict] = []

    def fake_llm(*args, **kwargs):
        calls.append(kwargs)
        raise Built

    monkeypatch.setattr("tandem.llm.LLM", fake_llm)
    return calls


@pytest.mark.parametrize(
    "argv, modes",
    [
        (["generate", "--graph-mode", "compiled"], ["compiled"]),
        (["generate"], ["auto"]),
        (["serve", "--draft", "none", "--graph-mode", "eager"], ["eager"]),
        (["bench", "--models", "demo-llama", "--graph-mode", "compiled", "eager"], ["compiled"]),  # the first LLM
    ],
)
def test_the_graph_mode_flag_reaches_the_llm(llm_kwargs, argv, modes):
    with pytest.raises(Built):
        main(argv)
    assert [kwargs["graph_mode"] for kwargs in llm_kwargs] == modes


def test_an_unknown_graph_mode_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--graph-mode", "fast"])
    assert exit_info.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, setting, value",
    [
        (["generate", "--no-adaptive"], "adaptive", False),
        (["generate"], "adaptive", True),
        (["serve", "--draft", "none", "--no-adaptive"], "adaptive", False),
        (["generate", "--draft", "none", "--async-scheduling"], "async_scheduling", True),
        (["generate"], "async_scheduling", None),
        (["generate", "--no-async-scheduling"], "async_scheduling", False),
        (["serve", "--draft", "none", "--async-scheduling"], "async_scheduling", True),
        (["generate"], "lookahead", None),
        (["generate", "--no-lookahead"], "lookahead", False),
        (["serve", "--lookahead"], "lookahead", True),
    ],
)
def test_the_adaptive_async_scheduling_and_lookahead_flags_reach_the_llm(llm_kwargs, argv, setting, value):
    with pytest.raises(Built):
        main(argv)
    assert [kwargs[setting] for kwargs in llm_kwargs] == [value]
