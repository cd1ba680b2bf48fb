"""The app for a model (`build_app`), and `ServerThread` to serve it in-process.

`ServerThread` serves an app with uvicorn on a background thread (tests, examples and the load
benchmark use it); `tandem serve` (`tandem.cli.serve`) is the foreground server.
"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

from tandem.assets import DEFAULT_MODEL

STARTUP_TIMEOUT_S = 30.0
SUFFIX_STORE_TOKENS = 32768  # the suffix draft's store of finished requests (prompts and outputs), in tokens


def build_app(
    model: str = DEFAULT_MODEL,
    draft: str | None = "auto",
    num_speculative_tokens: int = 4,
    served_model_name: str | None = None,
    max_num_seqs: int = 8,
    graph_mode: str = "auto",
    suffix_store_tokens: int = SUFFIX_STORE_TOKENS,
) -> FastAPI:
    """Load the model (and its draft: "auto" = the best one available, None = plain decoding) and
    return the app serving it; `graph_mode` as `tandem.LLM`'s. With the suffix draft, finished
    requests go into a store of `suffix_store_tokens` tokens (0: none) that later requests draft from,
    matched by content (`tandem.models.drafts.suffix.SuffixStore`)."""
    from tandem.llm import LLM, best_draft, resolve_model
    from tandem.models.drafts.suffix import SuffixDraft, SuffixStore
    from tandem.serve.app import create_app

    draft = best_draft(resolve_model(model)) if draft == "auto" else draft
    llm = LLM(
        model, draft, num_speculative_tokens=num_speculative_tokens, max_num_seqs=max_num_seqs, graph_mode=graph_mode
    )
    if isinstance(llm.draft, SuffixDraft) and suffix_store_tokens > 0:
        llm.draft.store = SuffixStore(suffix_store_tokens, max_depth=llm.draft.max_depth)
    return create_app(llm, served_model_name or model, draft)


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
