"""DeepSeek-V3 target: multi-head latent attention (MLA) over a compressed-latent KV cache, MoE.

MLA (DeepSeek-V2 paper, section 2.1), per token x:

    q          = q_b(norm(q_a(x)))  or  q_proj(x)          # [nh, nope + rope]
    c, k_pe    = kv_a_proj_with_mqa(x)                      # latent [r], shared rotary key [rope]
    cache     <- (kv_a_layernorm(c), RoPE(k_pe))            # r + rope numbers per token and layer
    kv_b       = [W_uk | W_uv] per head                      # [nh, nope + v, r]

Attention uses the absorbed form, so the cache is never re-expanded to per-head K/V:
``q_nope . (W_uk c) = (W_uk^T q_nope) . c``, hence scores come from the latent query
``cat(W_uk^T q_nope, RoPE(q_pe))`` against the cached ``cat(c, k_pe)`` (one shared "head"),
and ``sum_j a_j W_uv c_j = W_uv (sum_j a_j c_j)`` gives each head's value output. The
softmax scale is ``(nope + rope) ** -0.5``, times YaRN's ``mscale_all_dim`` correction.

Decoder layers ``< first_k_dense_replace`` use a dense SwiGLU MLP, the others the routed
MoE of :mod:`tandem.models.moe`. Key names are the published ones (``model.layers.{i}.self_attn.
kv_a_proj_with_mqa.weight``, ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, ...). The
settings are a :class:`~tandem.models.config.DeepseekV3Config`.

Over ``shard.size`` ranks (:class:`~tandem.models.parallel.Shard`) the model runs as SGLang serves it, with
data-parallel attention and an expert-parallel MoE; every rank is given the whole batch (SPMD) and its own cache:

- attention: MLA's weights whole on every rank; each rank runs it (cache writes included) for the rows of the
  slots it owns (:meth:`~tandem.models.parallel.Shard.owns_slot`, planned on the host from the batch's spans)
  and puts their outputs at those rows' tokens of a zero ``[T, H]``, which is all-reduced: every rank then holds
  every token's residual stream, exactly (each entry a sum with zeros). A rank may own no row of a step. In graph
  mode (:mod:`tandem.engine.graphs`) a step's shapes cannot follow the rows a rank owns: each rank runs attention
  over the whole padded batch, the rows it does not own planned as padding rows (they read and write only the
  scratch block), and zeroes their outputs (``owned``, a device tensor the runner fills) before the all-reduce.
- MLP: the dense layers' and the shared experts' intermediate columns split over the ranks, the routed
  experts whole per rank (expert parallel) or each split by columns (:mod:`tandem.models.moe`); each rank's
  partial sum is all-reduced once per layer (a sum in another order than one device's matmul takes).
- the embedding and the LM head whole on every rank (vocabulary-parallel is a later step).
- the MTP draft's layer (:mod:`tandem.models.drafts.mtp`) is a :class:`DecoderLayer` of this layout too, built
  with the target's shard: each rank attends its own rows in its own draft cache, holds its experts' share.

MLA's heads are not split (tensor-parallel attention): :func:`check_shard` refuses it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tandem.core.transfer import int64_tensor
from tandem.models.attention import RaggedLayout, sdpa
from tandem.models.base import (
    BlockTable,
    ForwardBatch,
    KVCache,
    RowSpans,
    Target,
    TargetOutput,
    default_aux_layer_ids,
)
from tandem.models.config import DeepseekV3Config
from tandem.models.layers import Layer
from tandem.models.linear import Linear, MergedLinear, linear
from tandem.models.loading import TakeFn, WeightReader, load_module, load_param
from tandem.models.mlp import GatedMLP
from tandem.models.moe import DeepseekMoE
from tandem.models.norm import RMSNorm
from tandem.models.parallel import SINGLE, Shard
from tandem.models.rope import RotaryEmbedding, Rotation


def check_shard(config: DeepseekV3Config, shard: Shard) -> None:
    """Refuse, with a ValueError naming the numbers, a parallel layout tandem does not run DeepSeek-V3 in:
    several ranks without data-parallel attention (MLA's heads are not split), or sizes the ranks do not divide
    (``intermediate_size``, ``n_routed_experts`` or ``moe_intermediate_size``, the shared experts'). Reads only
    the config: a launcher can call it before it starts any process or reads a weight."""
    if shard.parallel and not shard.data_parallel_attention:
        raise ValueError(
            f"DeepSeek-V3 over {shard.size} ranks runs with data-parallel attention in tandem "
            f"(data_parallel_size={shard.size}, experts split over the ranks): MLA's "
            f"{config.num_attention_heads} heads are not split (tensor_parallel_size={shard.size})"
        )
    if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        shard.part(config.intermediate_size, "intermediate_size")
    if config.n_routed_experts:
        inner = config.moe_intermediate_size
        if shard.expert_parallel:
            shard.part(config.n_routed_experts, "n_routed_experts")
        else:
            shard.part(inner, "moe_intermediate_size")
        shard.part(inner * config.n_shared_experts, "n_shared_experts * moe_intermediate_size")


def softmax_attention(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, *, scale: float) -> Tensor:
    """``scaled_dot_product_attention``'s arithmetic in four ops: ``query [..., Q, D]``, ``keys [..., L, D]``,
    ``values [..., L, Dv]``, additive ``mask [..., Q, L]`` -> ``[..., Q, Dv]``. On the CPU, sdpa runs its
    math fallback, in more ops, for values narrower than the keys (MLA's latents)."""
    scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(scale)
    return torch.matmul((scores if mask is None else scores.add_(mask)).softmax(-1), values)


def attend_latent(layout: RaggedLayout, query: Tensor, latent_cache: Tensor, value_dim: int, scale: float) -> Tensor:
    """Single-latent-head attention of every query head over its row's cached latents.

    Args:
        layout: the batch's :class:`~tandem.models.attention.RaggedLayout` (padding and visibility).
        query: ``[T, nh, D]`` latent queries (``D = kv_lora_rank + qk_rope_head_dim``).
        latent_cache: ``[num_blocks, block_size, D]``; the keys, whose first ``value_dim`` entries are the values.
    Returns:
        ``[T, nh, value_dim]`` in the query's dtype.

    A paged-attention kernel reads the latents through the block table where
    :meth:`~tandem.models.attention.RaggedLayout.reads_pools` says so (one key/value head, the values the keys'
    first ``value_dim`` entries); else the latents are gathered into a contiguous copy.
    """
    if layout.reads_pools(query):
        return layout.attend_paged(query, latent_cache[:, :, None], latent_cache[:, :, None, :value_dim], scale)
    num_rows, max_query = layout.num_rows, layout.max_query
    num_heads, dim = query.shape[1:]
    keys = layout.addressing.gather(latent_cache).unsqueeze(1)  # [B, 1, num_keys, D]
    # Heads fold into the query axis: one shared key/value head, as in MQA.
    attention = softmax_attention if query.device.type == "cpu" else sdpa
    out = attention(
        layout.to_grid(query).view(num_rows, 1, max_query * num_heads, dim),
        keys,
        keys[..., :value_dim],
        layout.attention_mask(query.dtype, repeats=num_heads),
        scale=scale,
    )
    return layout.from_grid(out.view(num_rows, max_query, num_heads, value_dim))


def own_rows(shard: Shard, batch: ForwardBatch, cache: KVCache) -> tuple[RaggedLayout | None, Tensor, Tensor]:
    """Data-parallel attention's plan, from the batch's host spans: ``(layout, positions [T_a], tokens [T_a])`` of
    the rows whose slots ``shard``'s rank owns, the layout over ``cache`` (None when it owns none) and the tokens'
    indices among the batch's T. The target's layers and the MTP draft's layer plan their attention with it."""
    spans, offsets = batch.spans, batch.spans.offsets()
    rows = [b for b, slot in enumerate(spans.slots) if shard.owns_slot(slot)]
    tokens = int64_tensor([t for b in rows for t in range(offsets[b], offsets[b + 1])], batch.input_ids.device)
    if not rows:
        return None, batch.positions[tokens], tokens
    if len(rows) < batch.num_rows:
        own = RowSpans(*([values[b] for b in rows] for values in (spans.starts, spans.lengths, spans.slots)))
        batch = ForwardBatch.build(batch.input_ids[tokens], own)
    return RaggedLayout.build(batch, cache), batch.positions, tokens


class MultiHeadLatentAttention(Layer):
    """MLA with the absorbed form over the latent cache: ``x: [T, H] -> [T, H]``."""

    def __init__(self, config: DeepseekV3Config, softmax_scale_factor: float, **factory):
        super().__init__()
        hidden, self.num_heads = config.hidden_size, config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        self.q_rank = config.q_lora_rank
        bias, eps = config.attention_bias, config.rms_norm_eps
        q_out, kv_a_out = self.num_heads * (self.nope_dim + self.rope_dim), self.kv_rank + self.rope_dim
        if self.q_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False, **factory)
            self.kv_a_proj_with_mqa = Linear(hidden, kv_a_out, bias=bias, **factory)
        else:  # both down-projections read x: one matmul
            parts = {"q_a_proj": self.q_rank, "kv_a_proj_with_mqa": kv_a_out}
            self.qkv_a_proj = MergedLinear(hidden, parts, bias=bias, **factory)
            self.q_a_layernorm = RMSNorm(self.q_rank, eps=eps, **factory)
            self.q_b_proj = Linear(self.q_rank, q_out, bias=False, **factory)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=eps, **factory)
        # Read by bmm, never by `linear`: stored narrower, it would be widened per call.
        kv_b_out = self.num_heads * (self.nope_dim + self.v_dim)
        self.kv_b_proj = Linear(self.kv_rank, kv_b_out, bias=False, narrowable=False, **factory)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=bias, **factory)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5 * softmax_scale_factor

    def forward(self, x: Tensor, rope: Rotation, layout: RaggedLayout, latent_cache: Tensor) -> Tensor:
        """Write this batch's latents into ``latent_cache [num_blocks, block_size, r + rope]`` and attend.

        ``x: [T, H]``, ``rope``: the :class:`RotaryEmbedding` of the tokens' positions -> ``[T, H]``.
        """
        if self.q_rank is None:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            q_a, kv_a = self.qkv_a_proj(x).split(self.qkv_a_proj.sizes, dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q_nope, q_pe = q.view(x.shape[0], self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = kv_a.split([self.kv_rank, self.rope_dim], dim=-1)
        layout.addressing.write(
            latent_cache, torch.cat([self.kv_a_layernorm(latent), rope.apply(k_pe[:, None]).flatten(1)], dim=-1)
        )
        kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        # Head-batched matmuls: einsum would add its own permutes and reshapes to every layer.
        q_latent = torch.bmm(q_nope.transpose(0, 1), kv_b[:, : self.nope_dim]).transpose(0, 1)  # [T, nh, r]
        query = torch.cat([q_latent, rope.apply(q_pe)], dim=-1)  # [T, nh, r + rope]
        out_latent = attend_latent(layout, query, latent_cache, self.kv_rank, self.scale)  # [T, nh, r]
        out = torch.bmm(out_latent.transpose(0, 1), kv_b[:, self.nope_dim :].transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.flatten(1))

    def load(self, take: TakeFn, prefix: str) -> None:
        """Read ``{prefix}{q_a_proj,q_a_layernorm,q_b_proj | q_proj, kv_a_proj_with_mqa, ...}.*``."""
        load_module(self, take, prefix)


class DecoderLayer(Layer):
    """Pre-norm residual block: MLA, then a dense SwiGLU MLP or the MoE. ``x: [T, H] -> [T, H]``.

    Over several ranks (``shard``, the module docstring): attention data-parallel; the dense MLP
    tensor-parallel (:class:`~tandem.models.mlp.GatedMLP`) and the MoE each all-reduce their partial sums.
    """

    def __init__(
        self, config: DeepseekV3Config, layer_id: int, softmax_scale_factor: float, *, shard: Shard = SINGLE, **factory
    ):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.shard = shard
        self.input_layernorm = RMSNorm(hidden, eps=eps, **factory)
        self.self_attn = MultiHeadLatentAttention(config, softmax_scale_factor, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, **factory)
        if config.is_moe_layer(layer_id):
            self.mlp = DeepseekMoE(config, shard=shard, **factory)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, shard=shard, **factory)

    def forward(
        self,
        x: Tensor,
        rope: Rotation | None,
        layout: RaggedLayout | None,
        latent_cache: Tensor,
        attention_tokens: Tensor | None = None,
        owned: Tensor | None = None,
    ) -> Tensor:
        """``x: [T, H]``; ``rope`` and ``layout`` are those of the tokens attention runs over: all T, or under
        data-parallel attention either those of ``attention_tokens [T_a] int64`` (their indices among the T: this
        rank's rows; ``rope`` and ``layout`` None when it owns none), or, in graph mode, all T again with ``owned
        [T] bool`` marking this rank's rows' tokens (the others ran as padding rows: their outputs are zeroed)."""
        if attention_tokens is not None:
            x = x + self.shard.all_reduce(self.attend_rows(x, rope, layout, latent_cache, attention_tokens))
        elif owned is not None:
            out = self.self_attn(self.input_layernorm(x), rope, layout, latent_cache)
            x = x + self.shard.all_reduce(out.masked_fill(~owned[:, None], 0))
        else:
            x = x + self.self_attn(self.input_layernorm(x), rope, layout, latent_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def attend_rows(
        self, x: Tensor, rope: Rotation | None, layout: RaggedLayout | None, latent_cache: Tensor, tokens: Tensor
    ) -> Tensor:
        """This rank's part of data-parallel attention: ``[T, H]``, the attention outputs of its rows' tokens
        (``tokens [T_a]``) at their places, zero at the others'."""
        if layout is None:
            return torch.zeros_like(x)
        if tokens.shape[0] == x.shape[0]:  # every row is this rank's: the tokens in order
            return self.self_attn(self.input_layernorm(x), rope, layout, latent_cache)
        out = self.self_attn(self.input_layernorm(x[tokens]), rope, layout, latent_cache)
        return torch.zeros_like(x).index_copy_(0, tokens, out)

    def load(self, take: TakeFn, prefix: str) -> None:
        """Read every tensor of ``{prefix}*`` (``model.layers.{i}.``)."""
        load_param(self.input_layernorm.weight, take, f"{prefix}input_layernorm.weight")
        load_param(self.post_attention_layernorm.weight, take, f"{prefix}post_attention_layernorm.weight")
        self.self_attn.load(take, f"{prefix}self_attn.")
        if isinstance(self.mlp, DeepseekMoE):
            self.mlp.load(take, f"{prefix}mlp.")
        else:
            load_module(self.mlp, take, f"{prefix}mlp.")

    def foreign_keys(self, prefix: str) -> list[str]:
        """Regexes (``re.match``) of the keys of ``{prefix}*`` :meth:`load` leaves to other ranks: their routed
        experts'."""
        return self.mlp.experts.foreign_keys(f"{prefix}mlp.experts.") if isinstance(self.mlp, DeepseekMoE) else []


class DeepseekV3(nn.Module):
    """DeepSeek-V3 target (:class:`tandem.models.base.Target`): embedding, MLA/MoE layers, norm, LM head.

    Args:
        config: the checkpoint's settings.
        aux_layer_ids: EAGLE-3 capture points (HF ``hidden_states`` indices); default
            :func:`~tandem.models.base.default_aux_layer_ids`.
        dtype, device: of the parameters and caches (the router bias stays float32).
        shard: this rank's place (the module docstring); ValueError for a layout :func:`check_shard` refuses.
            Construction runs no collective (a meta-device model needs no process group).
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        *,
        aux_layer_ids: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shard: Shard = SINGLE,
    ):
        super().__init__()
        check_shard(config, shard)
        factory = {"dtype": dtype, "device": device}
        self.config, self.checkpoint_dir, self.shard = config, None, shard
        self.vocab_size, self.hidden_size = config.vocab_size, config.hidden_size
        self.dtype = dtype or torch.get_default_dtype()
        self.num_layers = config.num_hidden_layers
        self.aux_layer_ids = tuple(aux_layer_ids or default_aux_layer_ids(self.num_layers))
        self.rope = RotaryEmbedding(config.rope, config.qk_rope_head_dim, self.dtype)
        self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size, **factory)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rope.softmax_scale_factor, shard=shard, **factory)
            for i in range(self.num_layers)
        )
        self.norm = RMSNorm(self.hidden_size, eps=config.rms_norm_eps, **factory)
        tied = config.tie_word_embeddings
        self.head = None if tied else Linear(self.hidden_size, self.vocab_size, bias=False, **factory)

    @property
    def data_parallel_attention(self) -> bool:
        """Whether each rank runs the attention of its own rows (several ranks)."""
        return self.shard.parallel and self.shard.data_parallel_attention

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> KVCache:
        """Latent pools ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` per layer over ``table``."""
        weight = self.embed_tokens.weight
        entry = (self.config.latent_dim,)
        return KVCache.allocate(
            self.num_layers, num_slots, max_len, entry, dtype=weight.dtype, device=weight.device, table=table
        )

    def embed(self, ids: Tensor) -> Tensor:
        """``ids: [T] int64`` -> ``[T, H]``."""
        return self.embed_tokens(ids)

    def lm_head(self, hidden: Tensor) -> Tensor:
        """``hidden: [N, H]`` (already normed) -> ``[N, V] float32``; the embedding matrix when tied."""
        weight = self.embed_tokens.weight if self.head is None else self.head.weight
        return linear(hidden, weight).float()

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, cache: KVCache, *, return_hidden: bool = False, return_aux: bool = False
    ) -> TargetOutput:
        """Write the batch's latents into ``cache`` and return logits ``[N, V] float32``.

        ``hidden`` is ``[T, H]`` after the final norm; ``aux_hidden`` is ``[T, len(aux_layer_ids) * H]``,
        the inputs of the layers in :attr:`aux_layer_ids` (index ``num_layers`` = the normed output).
        The host's part (checks, the layout: of this rank's rows under data-parallel attention), then
        :meth:`forward_layout`.
        """
        if return_aux and not all(0 <= i <= self.num_layers for i in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids {self.aux_layer_ids} outside hidden_states indices 0..{self.num_layers}")
        cache.begin_forward(batch.spans)
        if self.data_parallel_attention:
            layout, positions, tokens = own_rows(self.shard, batch, cache)
        else:
            layout, positions, tokens = RaggedLayout.build(batch, cache), batch.positions, None
        return self.forward_layout(
            layout,
            batch.input_ids,
            positions,
            cache.layers,
            batch.logits_indices,
            return_hidden,
            return_aux,
            attention_tokens=tokens,
        )

    def forward_layout(
        self,
        layout: RaggedLayout | None,
        input_ids: Tensor,
        positions: Tensor,
        layers: list[Tensor],
        logits_indices: Tensor | None = None,
        return_hidden: bool = False,
        return_aux: bool = False,
        attention_tokens: Tensor | None = None,
        owned: Tensor | None = None,
    ) -> TargetOutput:
        """The forward's tensor body over a planned ``layout``: ``input_ids [T] int64``, ``layers`` the cache's
        per-layer tensors; ``layout`` and ``positions [T_a] int64`` are those of the tokens attention runs over:
        all T, or under data-parallel attention this rank's rows' (:func:`own_rows`; ``layout`` None when it owns
        none), whose indices among the T are ``attention_tokens [T_a] int64`` (None: all T). Graph mode's static
        layout holds every row of the padded batch instead: under data-parallel attention it passes ``owned [T]
        bool``, this rank's rows' tokens (:meth:`DecoderLayer.forward`).

        Reads nothing back from the device, so it compiles into one graph (:mod:`tandem.engine.graphs`). Under
        data-parallel attention without ``attention_tokens`` or ``owned`` it raises ValueError: every rank would
        attend every row, into a cache that holds its own rows' entries only."""
        if attention_tokens is None and owned is None and self.data_parallel_attention:
            raise ValueError(
                f"DeepSeek-V3 with data-parallel attention over {self.shard.size} ranks: pass the rows this rank "
                "attends (attention_tokens, or graph mode's owned mask)"
            )
        rope = None if layout is None else self.rope(positions, layout.max_key)
        capture = self.aux_layer_ids if return_aux else ()
        captured: dict[int, Tensor] = {}
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            x = layer(x, rope, layout, layers[i], attention_tokens, owned)
        x = captured[self.num_layers] = self.norm(x)
        selected = x if logits_indices is None else x[logits_indices]
        return TargetOutput(
            logits=self.lm_head(selected),
            hidden=x if return_hidden else None,
            aux_hidden=torch.cat([captured[i] for i in capture], dim=-1) if return_aux else None,
        )

    def load(self, take: TakeFn) -> None:
        """Read ``model.embed_tokens``, ``model.layers.{i}.*``, ``model.norm`` and ``lm_head`` (unless tied)."""
        load_param(self.embed_tokens.weight, take, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load(take, f"model.layers.{i}.")
        load_param(self.norm.weight, take, "model.norm.weight")
        if self.head is not None:
            load_param(self.head.weight, take, "lm_head.weight")

    def foreign_keys(self) -> list[str]:
        """Regexes (``re.match``) of the checkpoint keys :meth:`load` leaves to other ranks: their routed experts'."""
        return [pattern for i, layer in enumerate(self.layers) for pattern in layer.foreign_keys(f"model.layers.{i}.")]


def build(
    config: DeepseekV3Config,
    weights: WeightReader,
    *,
    dtype: torch.dtype,
    device: torch.device,
    target: Target | None = None,
    shard: Shard = SINGLE,
) -> DeepseekV3:
    """The :mod:`tandem.models.loading` builder: a DeepSeek-V3 target with its checkpoint's weights (this rank's
    part of them over several ranks: only those bytes are read).

    The MTP layers (``model.layers.{L}.*`` and up) are left for :mod:`tandem.models.drafts.mtp`.
    """
    model = DeepseekV3(config, dtype=dtype, device="meta", shard=shard).to_empty(device=device)  # weights follow
    model.load(weights.take)
    weights.finish(ignore=[rf"model\.layers\.{i}\." for i in config.mtp_layer_ids] + model.foreign_keys())
    return model.eval().requires_grad_(False)
