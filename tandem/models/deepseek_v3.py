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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.models.attention import RaggedLayout
from tandem.models.base import BlockTable, ForwardBatch, KVCache, Target, TargetOutput, default_aux_layer_ids
from tandem.models.config import DeepseekV3Config
from tandem.models.layers import Layer
from tandem.models.linear import Linear, MergedLinear, linear
from tandem.models.loading import TakeFn, WeightReader, load_module, load_param
from tandem.models.mlp import GatedMLP
from tandem.models.moe import DeepseekMoE
from tandem.models.norm import RMSNorm
from tandem.models.rope import RotaryEmbedding, Rotation


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
    """
    num_rows, max_query = layout.num_rows, layout.max_query
    num_heads, dim = query.shape[1:]
    keys = layout.addressing.gather(latent_cache).unsqueeze(1)  # [B, 1, num_keys, D]
    # Heads fold into the query axis: one shared key/value head, as in MQA.
    attention = softmax_attention if query.device.type == "cpu" else F.scaled_dot_product_attention
    out = attention(
        layout.to_grid(query).view(num_rows, 1, max_query * num_heads, dim),
        keys,
        keys[..., :value_dim],
        layout.attention_mask(query.dtype, repeats=num_heads),
        scale=scale,
    )
    return layout.from_grid(out.view(num_rows, max_query, num_heads, value_dim))


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
    """Pre-norm residual block: MLA, then a dense SwiGLU MLP or the MoE. ``x: [T, H] -> [T, H]``."""

    def __init__(self, config: DeepseekV3Config, layer_id: int, softmax_scale_factor: float, **factory):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps=eps, **factory)
        self.self_attn = MultiHeadLatentAttention(config, softmax_scale_factor, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, **factory)
        if config.is_moe_layer(layer_id):
            self.mlp = DeepseekMoE(config, **factory)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, **factory)

    def forward(self, x: Tensor, rope: Rotation, layout: RaggedLayout, latent_cache: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layout, latent_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def load(self, take: TakeFn, prefix: str) -> None:
        """Read every tensor of ``{prefix}*`` (``model.layers.{i}.``)."""
        load_param(self.input_layernorm.weight, take, f"{prefix}input_layernorm.weight")
        load_param(self.post_attention_layernorm.weight, take, f"{prefix}post_attention_layernorm.weight")
        self.self_attn.load(take, f"{prefix}self_attn.")
        if isinstance(self.mlp, DeepseekMoE):
            self.mlp.load(take, f"{prefix}mlp.")
        else:
            load_module(self.mlp, take, f"{prefix}mlp.")


class DeepseekV3(nn.Module):
    """DeepSeek-V3 target (:class:`tandem.models.base.Target`): embedding, MLA/MoE layers, norm, LM head.

    Args:
        config: the checkpoint's settings.
        aux_layer_ids: EAGLE-3 capture points (HF ``hidden_states`` indices); default
            :func:`~tandem.models.base.default_aux_layer_ids`.
        dtype, device: of the parameters and caches (the router bias stays float32).
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        *,
        aux_layer_ids: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config, self.checkpoint_dir = config, None
        self.vocab_size, self.hidden_size = config.vocab_size, config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.aux_layer_ids = tuple(aux_layer_ids or default_aux_layer_ids(self.num_layers))
        self.rope = RotaryEmbedding(config.rope, config.qk_rope_head_dim, dtype or torch.get_default_dtype())
        self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size, **factory)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rope.softmax_scale_factor, **factory) for i in range(self.num_layers)
        )
        self.norm = RMSNorm(self.hidden_size, eps=config.rms_norm_eps, **factory)
        tied = config.tie_word_embeddings
        self.head = None if tied else Linear(self.hidden_size, self.vocab_size, bias=False, **factory)

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
        The host's part (checks, the layout), then :meth:`forward_layout`.
        """
        if return_aux and not all(0 <= i <= self.num_layers for i in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids {self.aux_layer_ids} outside hidden_states indices 0..{self.num_layers}")
        cache.begin_forward(batch)
        layout = RaggedLayout.build(batch, cache)
        return self.forward_layout(
            layout, batch.input_ids, batch.positions, cache.layers, batch.logits_indices, return_hidden, return_aux
        )

    def forward_layout(
        self,
        layout: RaggedLayout,
        input_ids: Tensor,
        positions: Tensor,
        layers: list[Tensor],
        logits_indices: Tensor | None = None,
        return_hidden: bool = False,
        return_aux: bool = False,
    ) -> TargetOutput:
        """The forward's tensor body over a planned ``layout``: ``input_ids, positions [T] int64``,
        ``layers`` the cache's per-layer tensors. Reads nothing back from the device, so it compiles
        into one graph (:mod:`tandem.engine.graphs`)."""
        rope = self.rope(positions, layout.max_key)
        capture = self.aux_layer_ids if return_aux else ()
        captured: dict[int, Tensor] = {}
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            x = layer(x, rope, layout, layers[i])
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


def build(
    config: DeepseekV3Config,
    weights: WeightReader,
    *,
    dtype: torch.dtype,
    device: torch.device,
    target: Target | None = None,
) -> DeepseekV3:
    """The :mod:`tandem.models.loading` builder: a DeepSeek-V3 target with its checkpoint's weights.

    The MTP layers (``model.layers.{L}.*`` and up) are left for :mod:`tandem.models.drafts.mtp`.
    """
    model = DeepseekV3(config, dtype=dtype, device="meta").to_empty(device=device)  # weights follow
    model.load(weights.take)
    weights.finish(ignore=[rf"model\.layers\.{i}\." for i in config.mtp_layer_ids])
    return model.eval().requires_grad_(False)
