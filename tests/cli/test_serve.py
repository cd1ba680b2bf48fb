"""`tandem serve` as its own process: it starts, answers one chat completion, and stops on SIGTERM."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from tandem.assets import ASSETS_DIR, DEFAULT_MODEL

MODEL = "demo-llama"
STARTUP_TIMEOUT_S = 120  # imports and model load on a busy 2-core machine
MAX_TOKENS = 24


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    """The base URL of `tandem serve --model demo-llama` on a free loopback port."""
    port = _free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "tandem.cli", "serve", "--model", MODEL, "--port", str(port), "--max-num-seqs=1"]
    command += ["--graph-mode", "eager"]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ASSETS_DIR.parents[1])
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, f"tandem serve exited {process.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"tandem serve not up in {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
            pytest.fail(f"tandem serve ignored SIGTERM:\n{log.read_text()}")


def test_serve_answers_a_chat_completion(served):
    with httpx.Client(base_url=served, timeout=60) as http:
        models = http.get("/v1/models").json()
        assert [card["id"] for card in models["data"]] == [MODEL]
        messages = [{"role": "user", "content": "Classify the sentiment of this review: the lamp broke."}]
        reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    assert choice["message"].get("reasoning_content") or choice["message"]["content"]
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    speculative = body["speculative_decoding"]
    assert speculative["draft"] == "eagle3"  # --draft auto: the model's best shipped draft
    assert 0 <= speculative["accepted"] <= speculative["drafted"]


def test_serve_passes_its_options_to_the_app(monkeypatch):
    from tandem.cli import main
    from tandem.serve.config import ServeConfig

    calls = []
    monkeypatch.setattr("tandem.serve.server.build_app", lambda *args: calls.append(args))
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: None)
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    main(["serve", "--draft", "suffix", "--graph-mode", "eager", "--suffix-store-tokens", "500", "--max-num-seqs", "2"])
    main(["serve", "--draft", "none", "--api-key", "k", "--max-new-tokens", "64", "--queue-timeout-s", "2.5"])
    main(["serve", "--model", "org/name", "--revision", "v1", "--max-queued-requests", "3", "--max-schema-depth", "9"])
    expected = ServeConfig(max_num_seqs=2, graph_mode="eager", suffix_store_tokens=500, api_key="from-env")
    assert calls[0] == (DEFAULT_MODEL, "suffix", expected)
    assert calls[1] == (DEFAULT_MODEL, None, ServeConfig(api_key="k", max_new_tokens=64, queue_timeout_s=2.5))
    limits = ServeConfig(revision="v1", api_key="from-env", max_queued_requests=3, max_schema_depth=9)
    assert calls[2] == ("org/name", "auto", limits)
    main(["serve", "--kv-cache-memory", "1000000", "--block-size", "8", "--no-prefix-caching"])
    main(["serve", "--max-num-batched-tokens", "0"])
    kv = ServeConfig(api_key="from-env", kv_cache_memory=1000000, block_size=8, enable_prefix_caching=False)
    assert calls[3] == (DEFAULT_MODEL, "auto", kv)
    assert calls[4] == (DEFAULT_MODEL, "auto", ServeConfig(api_key="from-env", max_num_batched_tokens=None))


def test_serve_without_the_server_extra_names_the_extra_to_install():
    """As after `pip install -e .`: fastapi missing gives one line and exit status 1, not a traceback."""
    code = "import sys; sys.modules['fastapi'] = None; from tandem.cli import main; sys.exit(main(['serve']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        'tandem serve: the server needs fastapi, which is not installed: pip install "tandem[serve]" '
        '(from a checkout: pip install -e ".[serve]")'
    ]
