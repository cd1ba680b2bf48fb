"""`ServeConfig`: every setting of a served model, in one typed place.

Engine settings are handed to `tandem.LLM` by `build_app`; server settings (the API key and the
limits) are read by the app. Every limit is refused with a 4xx error that names it and its value;
the defaults suit a server open to the network: requests large enough for any real chat or schema,
too small to exhaust memory or the request queue. This module imports no server dependency, so the
CLI can read its defaults without fastapi installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.grammars.spec import MAX_SCHEMA_DEPTH

API_KEY_ENV = "TANDEM_API_KEY"  # `tandem serve`'s API key when --api-key is not given
SUFFIX_STORE_TOKENS = 32768  # the suffix draft's store of finished requests (prompts and outputs), in tokens


@dataclass(frozen=True)
class ServeConfig:
    """How `build_app` loads the model and how the app serves it.

    Engine (passed to `tandem.LLM`): revision (of a hub model name), num_speculative_tokens, adaptive,
    max_num_seqs, graph_mode, async_scheduling and lookahead (None: `tandem.LLM`'s defaults), and the paged KV cache's
    kv_cache_memory (bytes; None: what max_num_seqs rows of the whole context need), block_size and
    enable_prefix_caching, and max_num_batched_tokens (the tokens one step verifies and prefills at most:
    longer prompts prefill in chunks), the parallel layout
    (tensor_parallel_size, data_parallel_size, enable_expert_parallel); with the suffix draft,
    finished requests go into a store of `suffix_store_tokens` tokens (0: none).

    Server: `served_model_name` is the model id clients send (None: the model argument). `api_key`:
    every /v1 route requires `Authorization: Bearer <api_key>` (None: open; /health and /metrics
    are always open). Limits, each refused with the status in brackets:

    max_body_bytes        request body size in bytes [413]
    max_new_tokens        new tokens one choice may ask for (`max_tokens`, `max_completion_tokens`;
                          None: the context) [400]; also the default of a request that asks none
    max_schema_bytes      a JSON schema's size as compact JSON, in bytes [400]
    max_schema_depth      a JSON schema's nesting depth (objects and arrays, at most
                          `tandem.grammars.spec.MAX_SCHEMA_DEPTH`) [400]
    max_queued_requests   HTTP requests waiting for an engine row (none of their choices runs yet) [429 beyond]
    queue_timeout_s       how long a request may wait for an engine row [503 after; it leaves the engine]
    """

    revision: str | None = None
    num_speculative_tokens: int = 4
    adaptive: bool = True
    max_num_seqs: int = 8
    graph_mode: str = "auto"
    async_scheduling: bool | None = None
    lookahead: bool | None = None
    kv_cache_memory: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = 2048
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    suffix_store_tokens: int = SUFFIX_STORE_TOKENS
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_new_tokens: int | None = None
    max_schema_bytes: int = 256 * 2**10
    max_schema_depth: int = 64
    max_queued_requests: int = 256
    queue_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_schema_bytes", "max_schema_depth", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig.{name} = {getattr(self, name)} must be >= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"ServeConfig.max_new_tokens = {self.max_new_tokens} must be >= 1 or None (the context)")
        if self.max_schema_depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"ServeConfig.max_schema_depth = {self.max_schema_depth}: the grammar pipeline takes schemas "
                f"at most {MAX_SCHEMA_DEPTH} levels deep"
            )
        if not self.queue_timeout_s > 0:
            raise ValueError(f"ServeConfig.queue_timeout_s = {self.queue_timeout_s} must be > 0")
        if self.api_key == "":
            raise ValueError("ServeConfig.api_key is empty: give a key, or None for an open server")
