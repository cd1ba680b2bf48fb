"""DeepSeek-V3's routed mixture of experts (dense layers use :class:`tandem.models.mlp.GatedMLP`).

Routing (DeepSeek-V3 "noaux_tc", as in the reference code and transformers 5.23):

    s      = sigmoid(x @ W_gate^T)                        # [T, E] float32 affinities
    c      = s + e_score_correction_bias                  # biased scores: for SELECTION only
    g      = sum of the top-2 of c within each of n_group groups
    keep the topk_group best groups, mask the other groups' experts to -inf in c
    experts = top-k of masked c                            # [T, k]
    weights = s[experts] (unbiased), / their sum if norm_topk_prob, * routed_scaling_factor
    y = sum_k weights_k * expert_k(x) + shared_experts(x)

The experts run one of two ways, equal up to the order of the sums, chosen in one place
(:meth:`RoutedExperts.runs_dense`): densely, every expert on every token weighted by its routing
(0 where not chosen), on the CPU while that extra work costs less than the dispatch's sorting,
gathering and per-expert calls (a step of a few tokens), and in a graph where the dispatch would
read the routing on the host; else dispatched, each expert on the tokens that chose it.

Over ``shard.size`` ranks (:class:`~tandem.models.parallel.Shard`; SGLang's EP MoE) the router is
replicated, so every rank, holding every token's hidden state, routes every token alike. The routed
experts are expert-parallel (``shard.expert_parallel``: rank r holds experts ``Shard.part(E)`` whole and
adds their weighted outputs for every token; the others' choices weigh 0 there) or else each expert is
split by its intermediate columns; the shared experts are split by columns. Each rank's output is then
a partial sum, and :class:`DeepseekMoE` all-reduces the routed and the shared parts together, once.

Every ``load`` method takes ``take(key, shape, *, dtype, part) -> Tensor`` (``WeightReader.take``, which
raises an error naming the key and both shapes, and reads only a rank's ``part`` of a sharded weight) and
the module's key prefix.
"""

from __future__ import annotations

import itertools
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.core.transfer import int64_tensor
from tandem.models.config import DeepseekV3Config
from tandem.models.layers import Layer
from tandem.models.linear import linear
from tandem.models.loading import Part, TakeFn, load_module, load_param
from tandem.models.mlp import GatedMLP
from tandem.models.parallel import SINGLE, Shard


def column_parts(shard: Shard) -> tuple[Part | None, Part | None]:
    """This rank's pieces of a SwiGLU split by its intermediate columns: ``(rows of gate/up [I, H], columns of
    down [H, I])``; ``(None, None)`` (the whole weights) on one rank."""
    if not shard.parallel:
        return None, None
    return Part(0, shard.rank, shard.size), Part(1, shard.rank, shard.size)


class GroupLimitedRouter(Layer):
    """Sigmoid-scored, group-limited top-k router with a selection-only correction bias.

    Scoring runs in float32 whatever the model dtype (the bias is stored in float32, as
    transformers keeps it).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        **factory,
    ):
        super().__init__()
        if num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(
                f"n_routed_experts={num_experts} must split into n_group={n_group} groups of at least 2 experts"
            )
        if not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(
                f"num_experts_per_tok={top_k} experts cannot be picked from topk_group={topk_group} of "
                f"n_group={n_group} groups of {num_experts // n_group} experts"
            )
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        device = factory.get("device")
        self.e_score_correction_bias = nn.Buffer(torch.zeros(num_experts, dtype=torch.float32, device=device))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Route ``x: [T, H]``. Returns ``(weights [T, k] float32, experts [T, k] int64)``."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        grouped = biased.view(x.shape[0], self.n_group, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept_groups = group_scores.topk(self.topk_group, dim=-1).indices
        dropped = torch.full_like(group_scores, float("-inf")).scatter_(1, kept_groups, 0.0)  # [T, G] additive
        experts = (grouped + dropped[..., None]).flatten(1).topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights.div_(weights.sum(dim=-1, keepdim=True).add_(1e-20))
        return weights.mul_(self.routed_scaling_factor), experts

    def load(self, take: TakeFn, prefix: str) -> None:
        """Read ``{prefix}weight [E, H]`` and ``{prefix}e_score_correction_bias [E]``."""
        load_param(self.weight, take, f"{prefix}weight")
        load_param(self.e_score_correction_bias, take, f"{prefix}e_score_correction_bias")


def has_grouped_mm(x: Tensor, weights: Tensor) -> bool:
    """Whether to use ``F.grouped_mm``: off the CPU, where the loop's read of the group ends would make
    the host wait for the device, and only where CUDA's kernel runs (bfloat16, compute capability
    8.0 or later, 16-byte aligned rows; the meta kernels check the same)."""
    if x.device.type == "cpu" or x.dtype != torch.bfloat16 or weights.dtype != x.dtype:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    return all(stride * t.element_size() % 16 == 0 for t in (x, weights) for stride in t.stride() if stride != 1)


def grouped_matmul(x: Tensor, weights: Tensor, ends: Tensor | list[int]) -> Tensor:
    """Each group's rows times its weight: ``x [N, K]`` sorted by group, ``weights [E, K, M]``, ``ends [E]
    int32`` (one past each group's last row; a list when the host planned the dispatch) -> ``[N, M]``.

    One ``F.grouped_mm`` call, which never reads the device, where :func:`has_grouped_mm`; else a
    loop over the groups that got rows, which reads ``ends`` once (free on the CPU), each group
    through :func:`linear` (on the CPU, the C kernel for narrowed experts).
    """
    if isinstance(ends, Tensor) and has_grouped_mm(x, weights):
        return F.grouped_mm(x, weights, offs=ends)
    out = x.new_empty(x.shape[0], weights.shape[2])
    start = 0
    for group, end in enumerate(ends if isinstance(ends, list) else ends.tolist()):
        if end > start:
            out[start:end] = linear(x[start:end], weights[group].T)
        start = end
    return out


# On the CPU the experts run densely while the work that adds to the dispatch's, T * (E - k) * 6 * I * H
# FLOPs, stays under this: about what the dispatch's sort, gathers and per-expert calls cost a few
# tokens. Past it the dispatch is faster.
DENSE_MAX_EXTRA_FLOPS = 8e6


class RoutedExperts(Layer):
    """E SwiGLU experts of intermediate size I, stored as one SwiGLU of intermediate size E * I whose
    units come in E groups: ``gate_up [E * 2I, H]`` holds expert e's gate rows, then its up rows,
    from row ``2I * e``; ``down [H, E * I]`` holds its columns from column ``I * e``.

    Over ``shard.size`` ranks, E and I are this rank's: experts ``first_expert .. first_expert + E - 1`` of
    ``total_experts`` whole (``shard.expert_parallel``), else all of them, each its ``1 / size`` of the
    intermediate columns. The output is then this rank's partial sum.

    Two ways to run them, equal up to the order of the sums:

    - dense (:meth:`dense`), on the CPU while every expert's work on every token costs little more
      than the dispatch (:meth:`runs_dense`): one linear per projection over all the
      experts, each expert's activations scaled by the token's routing weight for it (0 where the
      token did not choose it). Small experts are mostly all visited by a few tokens anyway.
    - dispatch (:meth:`dispatch`): the (token, expert) pairs sorted by expert, one
      :func:`grouped_matmul` per projection over the sorted rows, weighted and scattered back with
      ``index_add_``. On the CPU, where reading the routing is free, the host sorts the pairs.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *, shard: Shard = SINGLE, **factory):
        super().__init__()
        self.shard, self.total_experts = shard, num_experts
        if shard.expert_parallel:
            self.first_expert, num_experts = shard.part(num_experts, "n_routed_experts")
        else:
            self.first_expert, (_, intermediate_size) = 0, shard.part(intermediate_size, "moe_intermediate_size")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size, **factory))
        self.down = nn.Parameter(torch.empty(hidden_size, num_experts * intermediate_size, **factory))

    narrowable = ("gate_up", "down")  # read only through `linear` (`tandem.models.linear.narrow_exact_weights`)

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """``x: [T, H]``, ``weights: [T, k] float32``, ``experts: [T, k] int64`` (ids among all ``total_experts``)
        -> ``[T, H]`` in x's dtype."""
        run = self.dense if self.runs_dense(x, experts) else self.dispatch
        return run(x, weights, experts)

    def runs_dense(self, x: Tensor, experts: Tensor) -> bool:
        """Whether :meth:`forward` runs every expert on every token: on the CPU, while the work that adds to
        the dispatch's (``T * (E - k * E / total_experts)`` unchosen experts' SwiGLUs, on average) stays under
        :data:`DENSE_MAX_EXTRA_FLOPS`; and in graph mode wherever the dispatch would read the routing on the
        host (a graph holds no host reads): the CPU dispatch (``.tolist()``) under ``torch.compile``, and a
        CUDA graph's capture without ``F.grouped_mm`` (whose loop reads the group ends)."""
        if not x.is_cpu:
            return x.is_cuda and torch.cuda.is_current_stream_capturing() and not has_grouped_mm(x, self.gate_up)
        if torch.compiler.is_compiling():
            return True
        tokens, top_k = experts.shape
        chosen = top_k * self.num_experts / self.total_experts  # of this rank's experts, per token on average
        extra_flops = tokens * (self.num_experts - chosen) * 6 * self.intermediate_size * x.shape[1]
        return extra_flops <= DENSE_MAX_EXTRA_FLOPS

    @property
    def holds_some(self) -> bool:
        """Whether this rank holds only some of the experts (expert parallel over several ranks)."""
        return self.num_experts < self.total_experts

    def dense(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """:meth:`forward` running every expert on every token."""
        tokens, num_experts, inner = x.shape[0], self.num_experts, self.intermediate_size
        gate, up = linear(x, self.gate_up).view(tokens, num_experts, 2, inner).unbind(2)  # [T, E, I] each
        routing = weights.new_zeros(tokens, self.total_experts).scatter_(1, experts, weights)  # 0: not chosen
        if self.holds_some:
            routing = routing[:, self.first_expert : self.first_expert + num_experts]  # [T, E] this rank's
        scaled = (F.silu(gate) * up).mul_(routing[..., None]).to(x.dtype)
        return linear(scaled.view(tokens, num_experts * inner), self.down)

    def dispatch(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """:meth:`forward` running each expert on the tokens that chose it."""
        num_experts, inner = self.num_experts, self.intermediate_size
        order, ends, foreign = self.plan_on_host(experts) if x.is_cpu else self.plan_on_device(experts)
        tokens = order // experts.shape[1]
        gate_up = self.gate_up.view(num_experts, 2 * inner, -1).transpose(1, 2)  # [E, H, 2I]
        down = self.down.view(-1, num_experts, inner).permute(1, 2, 0)  # [E, I, H]
        gate, up = grouped_matmul(x[tokens], gate_up, ends).chunk(2, dim=-1)
        routed = grouped_matmul(F.silu(gate) * up, down, ends) * weights.flatten()[order, None]
        if foreign is not None:  # rows past the last group: no matmul wrote them
            routed = routed.masked_fill(foreign[:, None], 0.0)
        return torch.zeros_like(x).index_add_(0, tokens, routed.to(x.dtype))

    def plan_on_host(self, experts: Tensor) -> tuple[Tensor, list[int], None]:
        """The dispatch's order read on the host (free on the CPU): ``(order [P] int64, ends [E], None)``,
        ``order`` the flat (token, choice) pairs of this rank's experts grouped by expert, ``ends`` one past
        each group's last pair."""
        by_expert: list[list[int]] = [[] for _ in range(self.num_experts)]  # (token, choice) pairs by expert
        first, count = self.first_expert, self.num_experts
        for pair, expert in enumerate(experts.flatten().tolist()):
            if 0 <= expert - first < count:
                by_expert[expert - first].append(pair)
        order = int64_tensor(list(itertools.chain.from_iterable(by_expert)), experts.device)
        return order, list(itertools.accumulate(map(len, by_expert))), None

    def plan_on_device(self, experts: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The dispatch's order without a device read: ``(order [T * k] int64, ends [E] int32, foreign)``, every
        pair sorted by expert; with some of the experts, the others' pairs sort last, past ``ends[-1]``, and
        ``foreign [T * k]`` bool marks them (None: every pair is this rank's)."""
        local = experts.flatten()
        if self.holds_some:  # another rank's experts become expert `num_experts`, after this rank's
            local = local - self.first_expert
            local = local.masked_fill((local < 0) | (local >= self.num_experts), self.num_experts)
        sorted_experts, order = local.sort(stable=True)
        expert_ids = torch.arange(self.num_experts, device=experts.device)
        ends = torch.searchsorted(sorted_experts, expert_ids, right=True).to(torch.int32)
        return order, ends, sorted_experts == self.num_experts if self.holds_some else None

    def load(self, take: TakeFn, prefix: str) -> None:
        """Read ``{prefix}{e}.{gate,up,down}_proj.weight`` for this rank's experts e (the published layout),
        each whole (expert parallel) or its part of the intermediate columns."""
        inner = self.intermediate_size
        rows, columns = (None, None) if self.shard.expert_parallel else column_parts(self.shard)
        for local in range(self.num_experts):
            gate_up = self.gate_up[2 * inner * local : 2 * inner * (local + 1)]
            down = self.down[:, inner * local : inner * (local + 1)]
            key = f"{prefix}{self.first_expert + local}."
            load_param(gate_up[:inner], take, key + "gate_proj.weight", rows)
            load_param(gate_up[inner:], take, key + "up_proj.weight", rows)
            load_param(down, take, key + "down_proj.weight", columns)

    def foreign_keys(self, prefix: str) -> list[str]:
        """Regexes (``re.match``) of the checkpoint keys of the experts other ranks hold (``{prefix}{e}.``),
        which this rank never reads: one, or none when it holds every expert."""
        if not self.holds_some:
            return []
        mine = range(self.first_expert, self.first_expert + self.num_experts)
        others = "|".join(str(e) for e in range(self.total_experts) if e not in mine)
        return [rf"{re.escape(prefix)}({others})\."]


class DeepseekMoE(Layer):
    """Routed experts plus always-on shared experts: ``x: [T, H] -> [T, H]``.

    Args:
        config: reads ``n_routed_experts``, ``num_experts_per_tok``, ``n_group``, ``topk_group``,
            ``norm_topk_prob``, ``routed_scaling_factor``, ``moe_intermediate_size``,
            ``n_shared_experts`` and ``hidden_size``.
        shard: this rank's place; over several ranks each rank computes its partial sum of the routed and the
            shared experts' outputs, and one all-reduce sums them (the module docstring).
    """

    def __init__(self, config: DeepseekV3Config, *, shard: Shard = SINGLE, **factory):
        super().__init__()
        self.shard = shard
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = GroupLimitedRouter(
            hidden,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
            config.norm_topk_prob,
            config.routed_scaling_factor,
            **factory,
        )
        self.experts = RoutedExperts(hidden, inter, config.n_routed_experts, shard=shard, **factory)
        n_shared = config.n_shared_experts
        # This rank's columns of the shared experts: a partial sum, reduced with the routed experts' in one go.
        self.shared_experts = (
            GatedMLP(hidden, inter * n_shared, shard=shard, reduce=False, **factory) if n_shared else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = self.experts(x, *self.gate(x))
        return self.shard.all_reduce(out + self.shared_experts(x) if self.shared_experts is not None else out)

    def load(self, take: TakeFn, prefix: str) -> None:
        """Read ``{prefix}gate.*``, ``{prefix}experts.{e}.*`` and ``{prefix}shared_experts.*``."""
        self.gate.load(take, f"{prefix}gate.")
        self.experts.load(take, f"{prefix}experts.")
        if self.shared_experts is not None:
            load_module(self.shared_experts, take, f"{prefix}shared_experts.")
