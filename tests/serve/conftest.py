"""One real server on loopback for the whole session: the demo Llama with its best draft."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tandem.serve.server import ServerThread, build_app

MODEL = "demo-llama"


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    with ServerThread(build_app(MODEL)) as running:
        yield running


@pytest.fixture(scope="session")
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=60) as raw:
        yield raw
