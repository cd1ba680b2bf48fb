"""`--graph-mode`, `--adaptive` and `--async-scheduling` reach `tandem.LLM` from the commands that build one (the
model is not loaded)."""

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
    "argv, adaptive",
    [
        (["generate", "--no-adaptive"], False),
        (["generate"], True),
        (["serve", "--draft", "none", "--no-adaptive"], False),
    ],
)
def test_the_adaptive_flag_reaches_the_llm(llm_kwargs, argv, adaptive):
    with pytest.raises(Built):
        main(argv)
    assert [kwargs["adaptive"] for kwargs in llm_kwargs] == [adaptive]


@pytest.mark.parametrize(
    "argv, overlap",
    [
        (["generate", "--draft", "none", "--async-scheduling"], True),
        (["generate"], False),
        (["serve", "--draft", "none", "--async-scheduling"], True),
    ],
)
def test_the_async_scheduling_flag_reaches_the_llm(llm_kwargs, argv, overlap):
    with pytest.raises(Built):
        main(argv)
    assert [kwargs["async_scheduling"] for kwargs in llm_kwargs] == [overlap]
