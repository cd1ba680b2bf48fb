"""The app for a model (`build_app`), and `ServerThread` to serve it in-process.

`ServerThread` serves an app with uvicorn on a background thread (tests, examples and the load
benchmark use it); `tandem serve` (`tandem.cli.serve`) is the foreground server.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from tandem.assets import DEFAULT_MODEL
from tandem.serve.config import ServeConfig

STARTUP_TIMEOUT_S = 30.0


def build_app(
    model: str = DEFAULT_MODEL, draft: str | None = "auto", config: ServeConfig | None = None, **settings: Any
) -> FastAPI:
    """Load the model (and its draft: "auto" = the best one available, None = plain decoding) and
    return the app serving it as `config` says; `settings` replace fields of `config` (or of the
    default ServeConfig): `build_app("demo-llama", max_num_seqs=2, api_key="k")`."""
    from tandem.llm import LLM, best_draft, resolve_model
    from tandem.models.drafts.suffix import SuffixDraft, SuffixStore
    from tandem.serve.app import create_app

    config = dataclasses.replace(config or ServeConfig(), **settings)
    draft = best_draft(resolve_model(model, config.revision)) if draft == "auto" else draft
    llm = LLM(
        model,
        draft,
        revision=config.revision,
        num_speculative_tokens=config.num_speculative_tokens,
        adaptive=config.adaptive,
        max_num_seqs=config.max_num_seqs,
        graph_mode=config.graph_mode,
        async_scheduling=config.async_scheduling,
        lookahead=config.lookahead,
        kv_cache_memory=config.kv_cache_memory,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        max_num_batched_tokens=config.max_num_batched_tokens,
        tensor_parallel_size=config.tensor_parallel_size,
        data_parallel_size=config.data_parallel_size,
        enable_expert_parallel=config.enable_expert_parallel,
    )
    if isinstance(llm.draft, SuffixDraft) and config.suffix_store_tokens > 0:
        llm.draft.store = SuffixStore(config.suffix_store_tokens, max_depth=llm.draft.max_depth)
    return create_app(llm, config.served_model_name or model, draft, config)


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
