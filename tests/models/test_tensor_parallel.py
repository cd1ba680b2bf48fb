"""Llama 3 tensor parallel (issue 33): two gloo ranks on the CPU, each loading only its pieces, give the logits,
hidden and aux hidden states of the single-device model, eagerly and compiled whole; rank 0 keeps the drafts'
whole-vocabulary ``embed`` / ``lm_head``; each rank holds about half the sharded weights; a configuration the
ranks do not divide is refused with the reason.

One spawn runs every two-rank case (a spawn costs seconds on the 2-core machine); the ranks save what they
computed and this process compares it with the single-device model. Models are float32 with their bfloat16-exact
weights narrowed (the CPU engine's configuration, so the sharded weights take the narrowed paths too).

Tolerance on logits and hidden states: 2e-4 absolute plus 1e-4 relative, plus 2**-20 of the tensor's largest
magnitude. The ranks compute the same products as one device, but the row-parallel layers (``o_proj``,
``down_proj``) sum two partial products where one device sums one, and the matmuls are blocked differently over
half the columns (a compiled step's padded rows may take sgemm where one device's take the C kernel: past the AVX2
build's 16 rows), so float32 sums round differently through 16 layers, by an amount that scales with the
largest values summed, not with each output (seen: 3e-5 on the demo's logits, 4e-4 on aux hidden states of
magnitude 500, 2.8e-4 on one of 0.19 beside them); a wrong head, column or vocabulary piece moves them by orders
of magnitude more. Argmax (greedy) must be equal at every position
(the demo's closest top-two logits here are 0.06 apart).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from tandem.assets import ASSETS_DIR
from tandem.engine.graphs import GraphRunner
from tandem.models import ForwardBatch, load_target
from tandem.models.config import LlamaConfig
from tandem.models.linear import narrow_exact_weights
from tandem.models.llama3 import Llama3
from tandem.models.loading import checkpoint_tensors, load_tokenizer, read_config
from tandem.models.parallel import SINGLE, Shard, parameter_bytes
from tests.models.conftest import TINY_TIED_LLAMA

RANKS = 2
ATOL, RTOL = 2e-4, 1e-4
TEXTS = [
    "The kettle broke within a week, so I asked the shop for a refund and they sent a new one instead.",
    "What is twelve plus thirty? Add the two numbers: twelve and thirty make forty-two, the answer.",
    "A short story: the cat sat by the window all afternoon, watching the rain fall on the garden.",
]
PREFILL = [11, 6, 8]  # ragged prefills
VERIFY = [5, 5, 1]  # a verify step: two rows of t_last + 4 drafts, one decoding row
ACCEPTED = [2, 4, 0]  # drafts kept after the first verify; the cache rolls back past the others


def plan(tokens: list[list[int]]) -> list[tuple[list[list[int]], list[int]]]:
    """The forwards ``(rows, starts)`` over slots ``0..B-1``: a prefill, two decodes, and two verifies between
    which each row keeps its accepted drafts (the text's own tokens are the inputs)."""
    steps, ends = [], [0] * len(tokens)

    def step(widths: list[int]) -> None:
        steps.append(([row[e : e + w] for row, e, w in zip(tokens, ends, widths)], list(ends)))

    step(PREFILL)
    ends[:] = PREFILL
    for _ in range(2):
        step([1] * len(tokens))
        ends[:] = [e + 1 for e in ends]
    step(VERIFY)
    ends[:] = [e + 1 + a for e, a in zip(ends, ACCEPTED)]
    step(VERIFY)
    return steps


def new_cache(target, steps):
    """A contiguous cache of the plan's rows and a graph runner's scratch slot past them."""
    return target.new_cache(len(steps[0][0]) + GraphRunner.SCRATCH_SLOTS, 64)


def run_plan(target, steps, runner: GraphRunner | None = None) -> list[dict[str, torch.Tensor]]:
    """Every step's logits (all tokens), hidden and aux hidden, eagerly into a fresh cache, or through
    ``runner`` into its cache."""
    cache = new_cache(target, steps) if runner is None else runner.target_cache
    forward, outputs = target.forward if runner is None else runner.forward, []
    for rows, starts in steps:
        slots = list(range(len(rows)))
        cache.truncate(slots, starts)
        out = forward(ForwardBatch.from_rows(rows, starts, slots), cache, return_hidden=True, return_aux=True)
        outputs.append({"logits": out.logits, "hidden": out.hidden, "aux": out.aux_hidden})
    return outputs


def whole_vocabulary_ops(target) -> tuple[torch.Tensor, torch.Tensor]:
    """What the drafts read on rank 0: ``target.embed`` of every id and ``target.lm_head`` of fixed hidden states."""
    hidden = torch.randn(4, target.hidden_size, generator=torch.Generator().manual_seed(2))
    return target.embed(torch.arange(target.vocab_size)), target.lm_head(hidden)


def _rank(rank: int, port: int, models: list[Path], steps, out: Path) -> None:
    """One rank: each model loaded as its shard, run over the plan eagerly (and the demo compiled too); rank 0
    also calls the drafts' ``embed`` / ``lm_head`` alone, between the collectives both ranks make."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    shard = Shard(rank, RANKS)
    results = {}
    try:
        with torch.inference_mode():
            for i, path in enumerate(models):
                target = load_target(path, dtype=torch.float32, shard=shard)
                narrowed = narrow_exact_weights(target)
                eager = run_plan(target, steps[i])
                results[i] = {"eager": eager, "narrowed": narrowed, "kv": target.new_cache(1, 8).layers[0].shape}
                if rank == 0:
                    results[i]["embed"], results[i]["lm_head"] = whole_vocabulary_ops(target)
                if i == 0:
                    cache = new_cache(target, steps[i])
                    runner = GraphRunner(target, cache, widths=(max(VERIFY),), capture_sizes=(3,), backend="aot_eager")
                    results[i]["compiled"] = run_plan(target, steps[i], runner)
                    results[i]["graphs"], results[i]["fallbacks"] = len(runner._graphs), runner.fallbacks
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_checkpoint(path: Path) -> Path:
    """A random tiny Llama with :data:`TINY_TIED_LLAMA`'s settings, saved under its published keys."""
    config = {**read_config(ASSETS_DIR / "demo-llama"), **TINY_TIED_LLAMA}
    model = Llama3(LlamaConfig.from_dict(config), dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for key, tensor, _ in checkpoint_tensors(model.model, "model."):
        tensors[key] = (torch.randn(tensor.shape, generator=generator) * 0.2).to(torch.bfloat16).float()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory):
    """Per model (the demo, the tied and biased tiny one): the single-device target, how many weights it narrowed
    and its outputs over the plan; per rank: what it saved."""
    demo = ASSETS_DIR / "demo-llama"
    tiny = _tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    tokenizer = load_tokenizer(demo)
    demo_tokens = [tokenizer.encode(text) for text in TEXTS]
    generator = torch.Generator().manual_seed(1)
    tiny_tokens = [torch.randint(TINY_TIED_LLAMA["vocab_size"], (40,), generator=generator).tolist() for _ in TEXTS]
    models, steps = [demo, tiny], [plan(demo_tokens), plan(tiny_tokens)]
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank, args=(_free_port(), models, steps, out), nprocs=RANKS, join=True)
    singles = []
    with torch.inference_mode():
        for path, model_steps in zip(models, steps):
            single = load_target(path, dtype=torch.float32)
            narrowed = narrow_exact_weights(single)
            singles.append((single, narrowed, run_plan(single, model_steps)))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(RANKS)]
    return singles, ranks


def _close(got: dict, want: dict, where: str) -> None:
    for name in want:
        atol = ATOL + 2.0**-20 * want[name].abs().max().item()
        torch.testing.assert_close(
            got[name], want[name], atol=atol, rtol=RTOL, msg=lambda m, name=name: f"{where} {name}: {m}"
        )
    assert torch.equal(got["logits"].argmax(-1), want["logits"].argmax(-1)), f"{where}: a greedy token differs"


MODELS = pytest.mark.parametrize("model", [0, 1], ids=["demo-llama", "tied-biased"])


@MODELS
def test_two_ranks_give_the_single_device_logits_hidden_and_aux(parallel_run, model):
    singles, ranks = parallel_run
    expected = singles[model][2]
    for step, want in enumerate(expected):
        _close(ranks[0][model]["eager"][step], want, f"step {step}")
        for name, tensor in ranks[1][model]["eager"][step].items():  # one decision: the ranks agree bit for bit
            assert torch.equal(tensor, ranks[0][model]["eager"][step][name]), f"step {step} {name}: ranks differ"


@MODELS
def test_rank_zero_keeps_the_whole_vocabulary_embed_and_head(parallel_run, model):
    """The same ops over the same whole matrices as one device: equal, bit for bit. Rank 0 called them while rank
    1 did not: a collective inside would have paired with rank 1's next one and failed the run."""
    singles, ranks = parallel_run
    embed, lm_head = whole_vocabulary_ops(singles[model][0])
    assert torch.equal(ranks[0][model]["embed"], embed) and torch.equal(ranks[0][model]["lm_head"], lm_head)
    assert "embed" not in ranks[1][model]


@MODELS
def test_every_rank_narrows_its_pieces_and_caches_only_its_kv_heads(parallel_run, model):
    singles, ranks = parallel_run
    single, narrowed, _ = singles[model]
    kv = single.new_cache(1, 8).layers[0].shape  # [blocks, block_size, 2, nkv, d]
    for rank in ranks:
        assert rank[model]["narrowed"] == narrowed > 0
        assert rank[model]["kv"][3] * RANKS == kv[3] and rank[model]["kv"][4] == kv[4]


def test_the_compiled_forward_on_two_ranks_matches_one_device(parallel_run):
    """Graph mode: each rank's decode and verify steps (one shape: a decode pads to the verify's width) compile
    whole (aot_eager) with the collectives inside."""
    singles, ranks = parallel_run
    for rank in ranks:
        assert rank[0]["graphs"] == 1 and rank[0]["fallbacks"] == 1  # the prefill ran eagerly, the rest as graphs
        for step, want in enumerate(singles[0][2]):
            _close(rank[0]["compiled"][step], want, f"compiled step {step}")


REPLICATED = re.compile(r".*(norm\.weight|o_proj\.bias|down_proj\.bias)$")  # whole on every rank


VOCABULARY = re.compile(r"(model\.embed_tokens|lm_head_proj)\.")  # whole on rank 0, a piece elsewhere


def _bytes(model: Llama3, keep) -> int:
    """Parameter bytes of the checkpoint keys that ``keep(key)`` keeps."""
    return sum(tensor.numel() * tensor.element_size() for key, tensor, _ in checkpoint_tensors(model) if keep(key))


def _sharded(key: str) -> bool:
    return not VOCABULARY.match(key)


@pytest.mark.parametrize("name", ["demo-llama", "tiny"])
def test_each_rank_holds_half_of_the_sharded_weights(name):
    """Built on the meta device: no process group, no collective at construction."""
    config = LlamaConfig.from_dict(read_config(ASSETS_DIR / "demo-llama") | (TINY_TIED_LLAMA if name == "tiny" else {}))
    single = Llama3(config, dtype=torch.bfloat16, device="meta", shard=SINGLE)
    sharded, replicated = _bytes(single, _sharded), _bytes(single, REPLICATED.match)
    vocabulary = config.vocab_size * config.hidden_size * 2 * (1 if config.tie_word_embeddings else 2)
    assert parameter_bytes(single) == sharded + vocabulary
    for rank in range(RANKS):
        model = Llama3(config, dtype=torch.bfloat16, device="meta", shard=Shard(rank, RANKS))
        held = _bytes(model, _sharded)
        assert held == (sharded - replicated) // RANKS + replicated
        assert held <= sharded * (0.51 if name == "demo-llama" else 0.52)  # the norms and row-parallel biases
        assert parameter_bytes(model) - held == (vocabulary if rank == 0 else vocabulary // RANKS)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({}, "num_attention_heads: 6 does not divide over 4 ranks"),
        ({"num_attention_heads": 8}, "num_key_value_heads: 2 does not divide over 4 ranks"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2050}, "vocab_size: 2050"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 578}, "intermediate_size: 578"),
    ],
)
def test_a_configuration_the_ranks_do_not_divide_is_refused_with_the_reason(overrides, reason):
    config = LlamaConfig.from_dict(read_config(ASSETS_DIR / "demo-llama") | overrides)
    with pytest.raises(ValueError, match=reason):
        Llama3(config, dtype=torch.bfloat16, device="meta", shard=Shard(1, 4))


def test_a_layout_llama_has_no_use_for_is_refused():
    config = LlamaConfig.from_dict(read_config(ASSETS_DIR / "demo-llama"))
    for shard in (Shard(0, 2, data_parallel_attention=True), Shard(0, 2, expert_parallel=True)):
        with pytest.raises(ValueError, match="tensor parallelism only"):
            Llama3(config, dtype=torch.bfloat16, device="meta", shard=shard)
