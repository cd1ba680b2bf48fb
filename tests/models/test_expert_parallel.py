"""DeepSeek-V3 over 2 ranks (gloo, CPU, one spawn): data-parallel attention with the routed experts expert-parallel
or split by columns gives the single-device model's logits (argmax equal) and hidden states over a prefill, a
decode, a 5-token verify and a step where one rank owns no row; each rank reads and holds only its experts; the
MTP draft follows the target's layout (each rank's part of its layer gives the single-device draft's logits);
layouts tandem does not run are refused.

Tolerance: the float32 model's results up to the order of the MLP's sums. Each rank sums its experts' (or its
columns') products and the all-reduce adds the two partial sums, where one device sums them in one matmul, so
the two differ by float32 rounding, grown through 8 layers: logits within 1e-4, hidden states within 1e-5,
far below the logits' top-2 gaps on these inputs. The attention's all-reduce is exact (each entry a sum with zeros).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tandem.assets import ASSETS_DIR
from tandem.models import ForwardBatch, WeightReader
from tandem.models import deepseek_v3 as provider
from tandem.models.config import DeepseekV3Config
from tandem.models.deepseek_v3 import DeepseekV3
from tandem.models.drafts import mtp
from tandem.models.loading import read_config
from tandem.models.moe import RoutedExperts
from tandem.models.parallel import SINGLE, Shard
from tests.models import test_fp8

DEMO = ASSETS_DIR / "demo-deepseek"
LOGITS_TOLERANCE, HIDDEN_TOLERANCE = 1e-4, 1e-5
checkpoints = test_fp8.checkpoints  # the demo quantized to FP8 blocks, and dequantized (a fixture)
PROMPT_LENGTHS = (10, 7, 12)  # slots 0, 1, 2: rank 0 owns slots 0 and 2, rank 1 slot 1; 29 tokens take the
#                               experts' dispatch, the later steps (at most 15 tokens) their dense path
TOKENS = torch.randint(0, 2048, (64,), generator=torch.Generator().manual_seed(0)).tolist()  # the demo's vocabulary


def config() -> DeepseekV3Config:
    return DeepseekV3Config.from_dict(read_config(DEMO))


def load(shard: Shard, path: Path = DEMO) -> tuple[DeepseekV3, WeightReader]:
    """The float32 demo-deepseek target (from ``path``) of ``shard``'s layout, and the reader it was loaded from."""
    weights = WeightReader(path, dtype=torch.float32)
    model = provider.build(config(), weights, dtype=torch.float32, device=torch.device("cpu"), shard=shard)
    return model, weights


def steps(model: DeepseekV3) -> list[dict[str, torch.Tensor]]:
    """Logits and hidden states of: a prefill of 3 rows (slots 0, 1, 2), a decode of each, a 5-token verify of
    each (rows out of slot order), then a decode of slots 0 and 2 alone (rank 1 owns none of them)."""
    tokens, cache = TOKENS, model.new_cache(3, 64)
    lengths = list(PROMPT_LENGTHS)
    batches = [ForwardBatch.from_rows([tokens[:n] for n in lengths], [0, 0, 0], [0, 1, 2])]
    batches.append(ForwardBatch.from_rows([[tokens[n]] for n in lengths], lengths, [0, 1, 2]))
    starts = [n + 1 for n in lengths]
    order = [2, 0, 1]
    rows = [tokens[40 + 5 * b : 45 + 5 * b] for b in order]
    batches.append(ForwardBatch.from_rows(rows, [starts[b] for b in order], order))
    batches.append(ForwardBatch.from_rows([[tokens[60]], [tokens[61]]], [starts[2] + 5, starts[0] + 5], [2, 0]))
    outputs = []
    for batch in batches:
        out = model(batch, cache, return_hidden=True)
        outputs.append({"logits": out.logits, "hidden": out.hidden})
    return outputs


def draft_logits(target: DeepseekV3, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP draft's logits over the prefill's pairs ``(h_{p-1}, x_p)``, from the target's prefill ``hidden``."""
    draft = mtp.build(
        config(), WeightReader(DEMO, dtype=torch.float32), dtype=torch.float32, device="cpu", target=target
    )
    offsets = [0, *torch.tensor(PROMPT_LENGTHS).cumsum(0).tolist()]
    pairs = torch.cat([hidden[offsets[b] : offsets[b + 1] - 1] for b in range(3)])
    batch = ForwardBatch.from_rows([TOKENS[1:n] for n in PROMPT_LENGTHS], [1, 1, 1], [0, 1, 2])
    return draft.logits(draft.step(batch, pairs, draft.new_cache(3, 64)))


def routed_bytes(model: DeepseekV3) -> int:
    """Bytes of the routed experts' weights the model holds."""
    return sum(
        p.nbytes for layer in model.layers if hasattr(layer.mlp, "experts") for p in layer.mlp.experts.parameters()
    )


def run_rank(rank: int, port: int, out_dir: Path) -> None:
    """One rank: both layouts' steps and MTP logits into ``out_dir/rank{rank}.pt``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        results = {}
        for expert_parallel in (True, False):
            model, _ = load(Shard(rank, 2, data_parallel_attention=True, expert_parallel=expert_parallel))
            outputs = steps(model)
            results[expert_parallel] = {"steps": outputs, "mtp": draft_logits(model, outputs[0]["hidden"])}
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' results, from one spawn of 2 processes."""
    out_dir = tmp_path_factory.mktemp("ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(port, out_dir), nprocs=2)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


@pytest.fixture(scope="module")
def single() -> dict:
    model, _ = load(SINGLE)
    outputs = steps(model)
    return {"steps": outputs, "mtp": draft_logits(model, outputs[0]["hidden"]), "routed_bytes": routed_bytes(model)}


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["expert-parallel", "experts-by-columns"])
def test_two_ranks_match_one_device(ranks, single, expert_parallel):
    for rank in range(2):
        for step, (got, want) in enumerate(zip(ranks[rank][expert_parallel]["steps"], single["steps"], strict=True)):
            where = f"rank {rank}, step {step}"
            gap = (got["logits"] - want["logits"]).abs().max().item()
            assert gap <= LOGITS_TOLERANCE, f"{where}: logits differ by {gap}"
            assert torch.equal(got["logits"].argmax(-1), want["logits"].argmax(-1)), where
            gap = (got["hidden"] - want["hidden"]).abs().max().item()
            assert gap <= HIDDEN_TOLERANCE, f"{where}: hidden states differ by {gap}"
    # The all-reduces hand every rank the same sums: both ranks hold every token's logits alike.
    for got, other in zip(ranks[0][expert_parallel]["steps"], ranks[1][expert_parallel]["steps"]):
        assert torch.equal(got["logits"], other["logits"]) and torch.equal(got["hidden"], other["hidden"])


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["expert-parallel", "experts-by-columns"])
def test_the_mtp_draft_on_two_ranks_gives_one_devices_logits(ranks, single, expert_parallel):
    """Each rank runs its part of the MTP layer (its rows' attention, its experts) over the parallel target's
    hidden states; the all-reduces hand both ranks the same logits, the single-device draft's."""
    for rank in range(2):
        got, want = ranks[rank][expert_parallel]["mtp"], single["mtp"]
        assert (got - want).abs().max().item() <= LOGITS_TOLERANCE
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(ranks[0][expert_parallel]["mtp"], ranks[1][expert_parallel]["mtp"])


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["expert-parallel", "experts-by-columns"])
def test_each_rank_holds_half_of_the_routed_experts(single, expert_parallel):
    """Building runs no collective: each rank's part loads without a process group."""
    for rank in range(2):
        model, weights = load(Shard(rank, 2, data_parallel_attention=True, expert_parallel=expert_parallel))
        assert abs(routed_bytes(model) / single["routed_bytes"] - 0.5) < 0.01
        layer = model.layers[1].mlp  # the first MoE layer
        shared = layer.shared_experts.down_proj.weight.shape[1]
        assert shared == config().moe_intermediate_size // 2
        # Left unread: the MTP layer (model.layers.8) and the other rank's experts, every key of them.
        unread = [key for key in weights.unused() if not key.startswith("model.layers.8.")]
        experts = [re.match(r"model\.layers\.\d\.mlp\.experts\.(\d+)\.", key) for key in unread]
        assert all(experts)
        others = set(range(8)) - set(range(4 * rank, 4 * rank + 4)) if expert_parallel else set()
        assert {int(m[1]) for m in experts} == others
        assert len(unread) == 3 * len(others) * (config().num_hidden_layers - 1)  # gate, up, down per layer


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_experts_give_its_share_dense_and_dispatched_by_either_plan(rank, monkeypatch):
    """Rank ``rank`` of 2 holds experts 4 * rank .. 4 * rank + 3 of 8: each run adds their weighted outputs
    and nothing for the other rank's choices, with the dispatch planned on the host (the CPU's) or on the
    device (sorted, the other rank's pairs last and masked: checked here on the CPU)."""
    torch.manual_seed(rank)
    experts = RoutedExperts(16, 8, 8, shard=Shard(rank, 2, data_parallel_attention=True, expert_parallel=True))
    torch.nn.init.normal_(experts.gate_up), torch.nn.init.normal_(experts.down)
    x, weights = torch.randn(6, 16), torch.rand(6, 2)
    chosen = torch.stack([torch.randperm(8)[:2] for _ in range(6)])
    want = torch.zeros(6, 16)
    for token, choice in ((t, j) for t in range(6) for j in range(2)):
        local = chosen[token, choice].item() - 4 * rank
        if 0 <= local < 4:
            gate, up = (x[token] @ experts.gate_up[16 * local : 16 * (local + 1)].T).split(8)
            want[token] += weights[token, choice] * (experts.down[:, 8 * local : 8 * (local + 1)] @ (F.silu(gate) * up))
    assert want.abs().sum() > 0 and (want == 0).all(-1).any()  # tokens with and without this rank's experts
    runs = {"dense": experts.dense(x, weights, chosen), "host plan": experts.dispatch(x, weights, chosen)}
    monkeypatch.setattr(experts, "plan_on_host", experts.plan_on_device)
    runs["device plan"] = experts.dispatch(x, weights, chosen)
    for name, got in runs.items():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def piece(name: str, whole: torch.Tensor, rank: int, expert_parallel: bool) -> torch.Tensor:
    """What rank ``rank`` of 2 holds of the single-device model's parameter ``name`` (``whole``)."""
    if name.endswith("experts.gate_up"):  # [E * 2I, H]: each expert's gate rows, then its up rows
        experts = whole.view(8, 2, -1, whole.shape[1])
        return experts.chunk(2, 0 if expert_parallel else 2)[rank].flatten(0, 2)
    if name.endswith("experts.down"):  # [H, E * I]
        experts = whole.view(whole.shape[0], 8, -1)
        return experts.chunk(2, 1 if expert_parallel else 2)[rank].flatten(1)
    if ".mlp." in name and name.endswith("gate_up_proj.weight"):  # dense and shared: [2I, H], gate then up
        return whole.view(2, -1, whole.shape[1]).chunk(2, 1)[rank].flatten(0, 1)
    if ".mlp." in name and name.endswith("down_proj.weight"):  # [H, I]
        return whole.chunk(2, 1)[rank]
    return whole


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["expert-parallel", "experts-by-columns"])
def test_each_rank_reads_its_pieces_of_an_fp8_checkpoint(checkpoints, expert_parallel):
    """The FP8 blocks are 128 wide, the pieces (48 columns of an expert, 288 of the dense MLP) cut across them."""
    whole = dict(load(SINGLE, checkpoints[0])[0].named_parameters())
    for rank in range(2):
        model, _ = load(Shard(rank, 2, data_parallel_attention=True, expert_parallel=expert_parallel), checkpoints[0])
        for name, param in model.named_parameters():
            assert torch.equal(param, piece(name, whole[name], rank, expert_parallel)), name


def test_a_meta_model_builds_each_ranks_part_without_a_process_group():
    full = DeepseekV3(config(), dtype=torch.bfloat16, device="meta")
    part = DeepseekV3(
        config(),
        dtype=torch.bfloat16,
        device="meta",
        shard=Shard(3, 4, data_parallel_attention=True, expert_parallel=True),
    )
    assert routed_bytes(part) * 4 == routed_bytes(full)
    assert part.layers[1].mlp.experts.first_expert == 6


def test_the_mtp_draft_follows_the_targets_layout():
    """Rank 1 of 2 (expert parallel) reads experts 4..7 of the MTP layer and half the shared experts' columns."""
    shard = Shard(1, 2, data_parallel_attention=True, expert_parallel=True)
    weights = WeightReader(DEMO, dtype=torch.float32)
    target = DeepseekV3(config(), device="meta", shard=shard)
    draft = mtp.build(config(), weights, dtype=torch.float32, device="cpu", target=target)
    moe = draft.layer.mlp
    assert (moe.experts.num_experts, moe.experts.first_expert, moe.experts.shard) == (4, 4, shard)
    assert moe.shared_experts.down_proj.weight.shape[1] == config().moe_intermediate_size // 2
    unread = [key for key in weights.unused() if key.startswith("model.layers.8.mlp.experts.")]
    assert {int(key.split(".")[5]) for key in unread} == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        (Shard(0, 2), "runs with data-parallel attention"),
        (Shard(0, 3, data_parallel_attention=True, expert_parallel=True), "n_routed_experts: 8 does not divide over 3"),
        (Shard(0, 5, data_parallel_attention=True), "intermediate_size: 576 does not divide over 5"),
    ],
)
def test_layouts_tandem_does_not_run_are_refused(shard, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV3(config(), device="meta", shard=shard)
