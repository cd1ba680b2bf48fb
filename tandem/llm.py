"""`tandem.LLM`: the Python API over the engine."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from tandem.assets import ASSETS_DIR, DEFAULT_MODEL
from tandem.decoding.params import RelaxedAcceptance, SamplingParams
from tandem.engine import Engine, EngineConfig
from tandem.engine.engine import check_speculation
from tandem.engine.output import RequestOutput, StreamDelta
from tandem.engine.replicas import ReplicaProcesses, ReplicatedEngine, replica_devices
from tandem.engine.workers import ParallelConfig, Workers
from tandem.models import hub
from tandem.models.parallel import SINGLE

Prompt = str | Sequence[int]


class LLM:
    """A target model, an optional draft, a tokenizer and the engine that runs them.

    model: "demo-deepseek" (the default) or "demo-llama" (shipped in tandem/assets), a local
        Hugging Face directory or `.gguf` file, or a hub name "org/name" (`resolve_model`). draft: None
        (plain decoding), "eagle", "eagle3" (the draft shipped next to the model, `<model>-<kind>`),
        "mtp" (the target checkpoint's own MTP layers), "ngram", "suffix", a local draft checkpoint
        directory or a hub name. revision: the hub revision (branch, tag or commit) of a hub model name.
    dtype: None = the checkpoint's dtype on a GPU, float32 on the CPU (faster there than bf16).
        A float32 model on the CPU keeps the matmul weights that bfloat16 holds exactly (all of a
        bfloat16 checkpoint's) in bfloat16 and widens them per call: the same results from half
        the bytes, which decides a small model's speed there
        (:func:`tandem.models.linear.narrow_exact_weights`).
    graph_mode: "eager" runs every step op by op; "compiled" runs decode, verify and draft steps as
        compiled graphs (CUDA graphs on a GPU, inductor on the CPU); "auto" picks per device type
        (:class:`tandem.engine.EngineConfig`).
    capture_sizes: the batch sizes graphs are built for (None: 1, 2, 4, ... up to max_num_seqs).
    kv_cache_memory: bytes of paged KV cache per rank, target and draft entries together (None: what max_num_seqs
        rows of max_model_len take; under DeepSeek-V3's data-parallel attention each rank holds its own rows'
        blocks, so N ranks hold N times the rows); block_size: positions per KV block; enable_prefix_caching: a
        prompt reuses the cached blocks of its longest prefix seen before (`Engine.kv_stats` counts the hits).
    max_num_batched_tokens: the tokens one step feeds; a longer prefill goes in chunks between the running
        rows' steps (None: whole prompts in one step).
    async_scheduling: launch each plain decode step before reading the last one's tokens, so the host's work
        runs while the device computes (:mod:`tandem.engine.in_flight`; vLLM's ``--async-scheduling``); for a
        model without a draft on one device. Outputs are the synchronous engine's. None: on for such a model on
        CUDA in graph mode, off elsewhere.
    adaptive: choose each greedy row's drafts per step (0..num_speculative_tokens) from its acceptance and the
        measured cost of a verify (:mod:`tandem.engine.adaptive`); False: always num_speculative_tokens.
    lookahead: a chained draft (eagle, eagle3, mtp) in graph mode proposes right after the verify, from the tokens
        it emitted, before the host reads them (`Engine._lookahead`); outputs are the same. None: on CUDA.
    tensor_parallel_size, data_parallel_size, enable_expert_parallel: the target over several processes
        (:class:`tandem.engine.workers.ParallelConfig`): Llama 3 tensor-parallel, DeepSeek-V3 with data-parallel
        attention and, with enable_expert_parallel, whole experts per rank. This process drives the engine and
        holds rank 0; tandem starts the other ranks itself (one per GPU, gloo on the CPU) and stops them at
        :meth:`close` (or at exit). For a Llama model data_parallel_size means engine replicas
        (:class:`tandem.engine.replicas.ReplicatedEngine`): this engine and data_parallel_size - 1 processes with
        their own, requests balanced across them; with tensor_parallel_size each replica is a tensor-parallel
        engine of its own (on CUDA replica r holds GPUs r * tp to r * tp + tp - 1). Every replica takes every
        setting given here; they start side by side. parallel_timeout_s: how long a collective or a worker's
        answer may take before the engine ends naming the rank (:attr:`ParallelConfig.timeout_s`).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        draft: str | None = None,
        *,
        num_speculative_tokens: int = 4,
        grammar_backend: str = "auto",
        relaxed: RelaxedAcceptance | None = None,
        device: str = "auto",
        dtype: torch.dtype | None = None,
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        graph_mode: str = "auto",
        capture_sizes: Sequence[int] | None = None,
        revision: str | None = None,
        kv_cache_memory: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = 2048,
        async_scheduling: bool | None = None,
        adaptive: bool = True,
        lookahead: bool | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        parallel_timeout_s: float = ParallelConfig.timeout_s,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name != "self"}  # a replica's, below
        from transformers import AutoTokenizer

        from tandem.models.linear import narrow_exact_weights
        from tandem.models.loading import generation_eos_ids, load_draft, load_target, read_config

        check_speculation(draft is not None, num_speculative_tokens)  # before anything loads
        self.model_path = resolve_model(model, revision)
        device = resolve_device(device)
        if dtype is None and torch.device(device).type == "cpu":
            dtype = torch.float32  # CPUs without native bf16 matmuls run a bf16 checkpoint faster in fp32
        narrow = torch.device(device).type == "cpu" and dtype == torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        config = read_config(self.model_path)
        devices = [device]  # Llama's data parallelism: engine replicas (each one's rank 0 device), this one first
        if config.get("model_type") == "llama" and data_parallel_size > 1:
            devices = [str(d) for d in replica_devices(data_parallel_size, tensor_parallel_size, torch.device(device))]
            device, data_parallel_size = devices[0], 1
        parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel, parallel_timeout_s)
        parallel.check(config, torch.device(device))
        replicas = None
        if len(devices) > 1:  # started first: they build their engines while this process builds replica 0's
            settings = arguments | {"model": str(self.model_path), "revision": None, "data_parallel_size": 1}
            replicas = ReplicaProcesses([functools.partial(LLM, **settings | {"device": d}) for d in devices[1:]])
            weakref.finalize(self, replicas.close)
        self.workers: Workers | None = None
        shard = SINGLE
        if parallel.world_size > 1:
            self.workers = Workers.start(parallel, config, device, self.model_path, dtype, narrow)
            weakref.finalize(self, self.workers.close)
            shard = self.workers.shard
        self.target = load_target(self.model_path, dtype=dtype, device=device, shard=shard)
        self.draft = None
        if draft is not None:
            source = resolve_draft(draft, self.model_path)
            self.draft = load_draft(source, self.target, dtype=dtype, device=device)
            if self.workers is not None and getattr(self.draft, "shard", SINGLE).parallel:  # the target's layout (MTP)
                self.workers.load_draft(source, dtype, narrow)
        if narrow:
            for model in (self.target, self.draft):
                if isinstance(model, torch.nn.Module):
                    narrow_exact_weights(model)
        context = max_model_len or min(self.target.config.max_position_embeddings or 4096, 4096)
        self.engine = Engine(
            self.target,
            self.draft,
            self.tokenizer,
            EngineConfig(
                num_speculative_tokens=num_speculative_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=context,
                relaxed=relaxed,
                grammar_backend=grammar_backend,
                graph_mode=graph_mode,
                capture_sizes=None if capture_sizes is None else tuple(capture_sizes),
                kv_cache_memory=kv_cache_memory,
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                max_num_batched_tokens=max_num_batched_tokens,
                async_scheduling=async_scheduling,
                adaptive=adaptive,
                lookahead=lookahead,
                eos_token_ids=generation_eos_ids(self.model_path),
            ),
            self.workers,
        )
        if replicas is not None:
            self.engine = ReplicatedEngine(self.engine, replicas)

    def close(self) -> None:
        """Stop the worker processes of a parallel target and the other engine replicas (nothing to do on one
        device). Idempotent."""
        if self.workers is not None:
            self.workers.close()
        if isinstance(self.engine, ReplicatedEngine):
            self.engine.close()

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), batched continuously; outputs in prompt order."""
        params = params or SamplingParams()
        job = self.engine.compile_grammar(params)
        if job is not None:
            job.result()  # raises the grammar's error (invalid, refused, timed out) before anything runs
        ids = [self.engine.add_request(self.encode(p), params) for p in _as_list(prompts)]
        while self.engine.has_unfinished():
            self.engine.step()
        return [self.engine.pop_finished(request_id) for request_id in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield the request's new reasoning/answer text step by step, and the token ids of each step (a step whose
        tokens show no text yet, part of a character or a thinking marker, gives a delta with ids only); the last
        delta has a finish_reason."""
        request_id = self.engine.add_request(self.encode(prompt), params or SamplingParams())
        try:
            while True:
                for delta in self.engine.step():
                    if delta.request_id == request_id and (delta.token_ids or delta.has_content or delta.finish_reason):
                        yield delta
                    if delta.request_id == request_id and delta.finish_reason is not None:
                        self.engine.pop_finished(request_id)
                        return
        finally:
            self.engine.abort(request_id)

    def chat(
        self,
        messages: list[dict],
        params: SamplingParams | None = None,
        *,
        response_format: type | dict | None = None,
        tools: list[dict] | None = None,
    ) -> RequestOutput:
        """One chat turn through the tokenizer's chat template; `response_format` (a pydantic
        model class or a JSON schema dict) constrains the answer."""
        params = params or SamplingParams()
        if response_format is not None:
            params = dataclasses.replace(params, json_schema=response_format)
        return self.generate([self.chat_prompt(messages, tools)], params)[0]

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a chat turn (see `chat_prompt_ids`)."""
        return chat_prompt_ids(self.tokenizer, messages, tools)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (no special tokens added); ids pass through as ints."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return [int(t) for t in prompt]


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt ids of a chat turn: the tokenizer's chat template with the generation prompt,
    encoded without adding special tokens (the template has them)."""
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def resolve_device(device: str) -> str:
    """`device`, with "auto" read as cuda when there is a GPU, else cpu."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def resolve_model(model: str | Path, revision: str | None = None) -> Path:
    """The model directory a name means, tried in this order: a shipped demo name; a local directory
    (with a config.json) or `.gguf` file (converted once into a cached directory); a hub name "org/name"
    that is no local path (its snapshot at `revision`, from the cache or downloaded: `tandem.models.hub`)."""
    if (ASSETS_DIR / str(model)).is_dir():
        path = ASSETS_DIR / str(model)
    elif str(model).endswith(".gguf") and Path(model).is_file():
        from tandem.models.gguf import gguf_directory

        return gguf_directory(Path(model))
    elif hub.is_hub_name(str(model)):
        path = hub.snapshot(str(model), revision)
    else:
        path = Path(model)
    if not (path / "config.json").is_file():
        shipped = sorted(p.name for p in ASSETS_DIR.iterdir() if (p / "config.json").is_file())
        raise FileNotFoundError(f"model {model!r}: no config.json in {path}; shipped models: {shipped}")
    return path


def available_drafts(model_path: Path) -> list[str]:
    """Draft kinds usable with a model, strongest first: shipped EAGLE-3 / EAGLE drafts beside it,
    its own MTP layer (if the checkpoint has one), and the model-free n-gram and suffix drafts."""
    from tandem.models.loading import WeightReader, read_config

    kinds = [
        kind
        for kind in ("eagle3", "eagle")
        if (model_path.parent / f"{model_path.name}-{kind}" / "config.json").is_file()
    ]
    layers = read_config(model_path).get("num_hidden_layers")
    if f"model.layers.{layers}.eh_proj.weight" in WeightReader(model_path):
        kinds.append("mtp")
    return [*kinds, "ngram", "suffix"]


def best_draft(model_path: Path) -> str:
    """The strongest draft available for a model (see `available_drafts`)."""
    return available_drafts(model_path)[0]


def resolve_draft(draft: str, model_path: Path) -> str | Path:
    """ "ngram", "suffix" and "mtp" pass through; "eagle"/"eagle3" mean the draft shipped beside the model;
    then a local draft directory, then a hub name "org/name" (its snapshot, `pytorch_model.bin` included)."""
    if draft in ("ngram", "suffix", "mtp"):
        return draft
    if draft in ("eagle", "eagle3"):
        sibling = model_path.parent / f"{model_path.name}-{draft}"
        if not (sibling / "config.json").is_file():
            raise FileNotFoundError(f"draft {draft!r}: no {sibling.name} beside {model_path}")
        return sibling
    if (Path(draft) / "config.json").is_file():
        return Path(draft)
    if hub.is_hub_name(draft):
        return hub.snapshot(draft, files=hub.DRAFT_FILES)
    raise FileNotFoundError(
        f"draft {draft!r}: not a kind (eagle, eagle3, mtp, ngram, suffix), a directory with config.json "
        "nor a hub name (org/name)"
    )
