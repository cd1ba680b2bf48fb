"""The server over engine replicas (`tandem serve --data-parallel-size 2` on a Llama model): concurrent requests
spread over both replicas and answer as one engine does, and /metrics counts both replicas' KV blocks."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tandem.serve.server import ServerThread, build_app
from tests.serve.conftest import MODEL

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two replicas need two CPU cores")
QUESTIONS = ["What is 7 + 5?", "Name a river.", "Say hello.", "What is 2 * 3?"]


def _answers(server: ServerThread) -> list[str]:
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

    def ask(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(ask, QUESTIONS))


def test_two_replicas_serve_what_one_engine_does():
    with ServerThread(build_app(MODEL, max_num_seqs=2, graph_mode="eager")) as one:
        expected = _answers(one)
    app = build_app(MODEL, max_num_seqs=2, graph_mode="eager", data_parallel_size=2)
    try:
        with ServerThread(app) as two:
            assert _answers(two) == expected
            engine = app.state.server.llm.engine
            assert min(engine.assigned) >= 1  # both replicas served
            metrics = httpx.get(two.base_url.removesuffix("/v1") + "/metrics").text
    finally:
        app.state.server.llm.close()
    blocks = {
        sample.labels["state"]: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "tandem_kv_blocks"
    }
    assert blocks["total"] == 2 * app.state.server.llm.engine.local.blocks.num_total
