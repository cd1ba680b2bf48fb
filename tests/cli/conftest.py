"""Running `tandem COMMAND ...` in-process (`tandem.cli.main`) and reading what it printed.

Data outside the repository (MaskBench, JSON-Schema-Test-Suite) is found where
tests/grammars/conftest.py says (TANDEM_MASKBENCH, TANDEM_SCHEMA_SUITE, else ../shared/data);
the fixtures here skip the test when it is absent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.cli import main
from tests.grammars.conftest import MASKBENCH, SCHEMA_SUITE

Tandem = Callable[..., tuple[str, str]]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """`bench --threads` and `train-demo --threads` set torch's thread count for the whole process."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tandem(capsys) -> Tandem:
    """`tandem(*argv)`: run the command, require exit status 0, return its (stdout, stderr)."""

    def run(*argv: str) -> tuple[str, str]:
        capsys.readouterr()  # drop anything printed before
        status = main([str(arg) for arg in argv])
        out, err = capsys.readouterr()
        assert status == 0, f"tandem {' '.join(map(str, argv))} exited {status}\n{out}\n{err}"
        return out, err

    return run


def last_json_line(out: str) -> dict:
    """The JSON object on the last non-empty line of `out`."""
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def maskbench() -> Path:
    if not MASKBENCH.is_dir():
        pytest.skip(f"MaskBench not at {MASKBENCH} (set TANDEM_MASKBENCH to its folder)")
    return MASKBENCH


@pytest.fixture
def schema_suite() -> Path:
    if not SCHEMA_SUITE.is_dir():
        pytest.skip(f"JSON-Schema-Test-Suite not at {SCHEMA_SUITE} (set TANDEM_SCHEMA_SUITE to draft2020-12/)")
    return SCHEMA_SUITE
