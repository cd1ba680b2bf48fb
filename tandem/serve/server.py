"""`tandem serve`: run the OpenAI-compatible server, and `ServerThread` to run it in-process.

`ServerThread` serves an app with uvicorn on a background thread (tests, examples and the load
benchmark use it); `run` is the command line's foreground server.
"""

from __future__ import annotations

import argparse
import threading
import time

import uvicorn
from fastapi import FastAPI

from tandem.assets import DEFAULT_MODEL

STARTUP_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="demo-deepseek, demo-llama or a local HF directory")
    parser.add_argument("--draft", default="auto",
                        help="auto (the model's best shipped draft), none, eagle, eagle3, mtp, ngram or a directory")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def build_app(model: str = DEFAULT_MODEL, draft: str | None = "auto", num_speculative_tokens: int = 4,
              served_model_name: str | None = None, max_num_seqs: int = 8) -> FastAPI:
    """Load the model (and its draft: "auto" = the best one available, None = plain decoding) and
    return the app serving it."""
    from tandem.llm import LLM, best_draft, resolve_model
    from tandem.serve.app import create_app

    draft = best_draft(resolve_model(model)) if draft == "auto" else draft
    llm = LLM(model, draft, num_speculative_tokens=num_speculative_tokens, max_num_seqs=max_num_seqs)
    return create_app(llm, served_model_name or model, draft)


def run(args: argparse.Namespace) -> int:
    draft = None if args.draft == "none" else args.draft
    app = build_app(args.model, draft, args.num_speculative_tokens, args.served_model_name, args.max_num_seqs)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


class ServerThread:
    """Serve `app` with uvicorn on a background thread, as a context manager.

    `port=0` picks a free port; `base_url` is then the address it listens on
    (`http://127.0.0.1:<port>/v1`). Leaving the context shuts the server (and the engine thread) down.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="tandem-uvicorn", daemon=True)
        self.host, self.port = host, port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=STARTUP_TIMEOUT_S)
