"""DeepSeek-V3 multi-token prediction (MTP / NextN) as a draft.

The MTP module (DeepSeek-V3 report, section 2.2) turns the pair ``(h_{p-1}, x_p)`` into a
prediction of ``x_{p+1}``:

    u_p      = eh_proj(cat(enorm(embed(x_p)), hnorm(h_{p-1})))   # [H]: embedding FIRST
    g_p      = DecoderLayer(u_p)                                  # MLA (own latent cache) + MoE
    x_{p+1} ~ lm_head(shared_head.norm(g_p))

``h`` is the target's last hidden state after its final norm (``TargetOutput.hidden``). To
chain ``k > 1`` proposals the one layer is reused: the next pair is ``(g_p, x_{p+1})`` at
position ``p + 1``, with ``g_p`` taken BEFORE ``shared_head.norm`` (``hnorm`` normalises it
anyway; this is what vLLM's MTP proposer feeds back). Proposals are argmax (``probs=None``).

Weights: ``model.layers.{L}.*`` with ``L = num_hidden_layers``, either in the target's own
checkpoint (draft kind ``"mtp"``) or in a separate NextN checkpoint (architecture
``DeepseekV3ForCausalLMNextN``, same key names, as SGLang's export writes it). Only the first
MTP layer is used. The layer's ``embed_tokens`` and ``shared_head.head`` duplicate the target's
embedding and head, which the draft shares instead (like vLLM and SGLang).

Over several ranks the MTP layer follows the target's layout (its :class:`~tandem.models.parallel.Shard`, as
:mod:`tandem.models.deepseek_v3` describes it): attention data-parallel, each rank attending its own rows in its
own draft cache (in graph mode every row of the padded batch, the others' as padding rows, their outputs
zeroed); the MoE's experts split over the ranks and its shared experts by columns, their partial sums
all-reduced; each rank reads only its part of the layer. The small ``enorm``/``hnorm``/``eh_proj`` and the
shared head norm are whole on every rank, as are the embedding and LM head the draft borrows, and so are the
target's hidden states (data-parallel attention all-reduces them). Every rank runs each step (SPMD: the
driver's :meth:`propose`, the workers' :func:`~tandem.models.drafts.chained.follow_chained`, as
:mod:`tandem.engine.workers` sends them); only the driver runs the head and chooses the tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tandem.models.attention import RaggedLayout
from tandem.models.base import BlockTable, Draft, DraftInput, DraftProposal, ForwardBatch, KVCache, Target
from tandem.models.config import DeepseekV3Config
from tandem.models.deepseek_v3 import DecoderLayer, own_rows
from tandem.models.drafts.chained import propose_chained
from tandem.models.linear import Linear
from tandem.models.loading import CheckpointError, TakeFn, WeightReader, load_param
from tandem.models.norm import RMSNorm
from tandem.models.parallel import SINGLE, Shard
from tandem.models.rope import RotaryEmbedding


class MultiTokenPredictor(nn.Module, Draft):
    """DeepSeek-V3 MTP draft (:class:`tandem.models.base.Draft`) sharing ``target``'s embedding and head.

    Args:
        config: the settings of the DeepSeek-V3 checkpoint the MTP layer belongs to.
        target: the target whose ``embed`` / ``lm_head`` the draft uses (not registered as a submodule).
        shard: this rank's place, the target's (the module docstring); construction runs no collective.
    """

    hidden_kind = "last"
    follows_constraint = True

    def __init__(
        self,
        config: DeepseekV3Config,
        target: Target,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shard: Shard = SINGLE,
    ):
        super().__init__()
        if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
            raise ValueError(
                f"MTP layer (hidden_size={config.hidden_size}, vocab_size={config.vocab_size}) does not fit "
                f"the target (hidden_size={target.hidden_size}, vocab_size={target.vocab_size})"
            )
        factory = {"dtype": dtype, "device": device}
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_id = config.num_hidden_layers
        self.latent_dim, self.shard = config.latent_dim, shard
        self.dtype = dtype or torch.get_default_dtype()  # of the parameters, the cache and the rotations
        self.rope = RotaryEmbedding(config.rope, config.qk_rope_head_dim, self.dtype)
        self.enorm = RMSNorm(hidden, eps=eps, **factory)
        self.hnorm = RMSNorm(hidden, eps=eps, **factory)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False, **factory)
        self.layer = DecoderLayer(config, self.layer_id, self.rope.softmax_scale_factor, shard=shard, **factory)
        self.shared_head_norm = RMSNorm(hidden, eps=eps, **factory)
        self._embed, self._lm_head = target.embed, target.lm_head

    @property
    def prefix(self) -> str:
        """Checkpoint key prefix of the MTP layer: ``model.layers.{num_hidden_layers}.``."""
        return f"model.layers.{self.layer_id}."

    def new_cache(self, num_slots: int, max_len: int, *, table: BlockTable | None = None) -> KVCache:
        """One latent pool ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` over ``table``.

        Entries start at position 1: position 0 has no previous hidden state to pair with.
        """
        return KVCache.allocate(
            1,
            num_slots,
            max_len,
            (self.latent_dim,),
            dtype=self.dtype,
            device=self.eh_proj.weight.device,
            first_position=1,
            table=table,
        )

    def step(self, batch: ForwardBatch, hidden: Tensor, cache: KVCache) -> Tensor:
        """Run the MTP layer on pairs ``(hidden [T, H], batch.input_ids [T])``; returns ``g: [T, H]`` pre-norm
        (every token's on every rank: under data-parallel attention the layer attends this rank's rows only)."""
        cache.begin_forward(batch.spans)
        if self.shard.parallel and self.shard.data_parallel_attention:
            layout, positions, tokens = own_rows(self.shard, batch, cache)
        else:
            layout, positions, tokens = RaggedLayout.build(batch, cache), batch.positions, None
        return self.step_layout(layout, batch.input_ids, positions, hidden, cache.layers, tokens)

    def step_layout(
        self,
        layout: RaggedLayout | None,
        input_ids: Tensor,
        positions: Tensor,
        hidden: Tensor,
        layers: list[Tensor],
        attention_tokens: Tensor | None = None,
        owned: Tensor | None = None,
    ) -> Tensor:
        """:meth:`step`'s tensor body over a planned ``layout`` (``input_ids [T]``); compiles whole. ``layout`` and
        ``positions`` are those of the tokens attention runs over: all T, or under data-parallel attention this
        rank's rows' (``layout`` None when it owns none), whose indices among the T are ``attention_tokens``; in
        graph mode all T, with ``owned [T] bool`` marking this rank's rows' tokens
        (:meth:`~tandem.models.deepseek_v3.DecoderLayer.forward`)."""
        fused = self.eh_proj(torch.cat([self.enorm(self._embed(input_ids)), self.hnorm(hidden)], dim=-1))
        rope = None if layout is None else self.rope(positions, layout.max_key)
        return self.layer(fused, rope, layout, layers[0], attention_tokens, owned)

    def logits(self, g: Tensor) -> Tensor:
        """``g: [N, H]`` pre-norm MTP output -> ``[N, V] float32``."""
        return self._lm_head(self.shared_head_norm(g))

    target_logits = logits  # what a proposal takes its argmax of (graph mode's chain reads it by this name)

    @torch.inference_mode()
    def propose(self, inp: DraftInput, cache: KVCache, num_tokens: int) -> DraftProposal:
        """Consume the committed pairs of ``inp`` and chain ``num_tokens`` argmax proposals per row.

        ``inp.hidden: [T, H]`` is the target's normed hidden state at the position before each
        token. Writes cache entries at the committed positions and at the first
        ``num_tokens - 1`` proposed ones (the caller truncates before the next call).
        Returns ``tokens: [B, num_tokens] int64``, ``probs=None``.
        """
        if inp.hidden is None:
            raise ValueError("the MTP draft needs the target's hidden states (DraftInput.hidden is None)")
        tokens = propose_chained(inp.step or self.step, self.target_logits, inp, inp.hidden, cache, num_tokens)
        return DraftProposal(tokens=tokens, probs=None)

    def load(self, take: TakeFn) -> None:
        """Read ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}`` and the decoder layer's tensors."""
        for name, param in (
            ("enorm.weight", self.enorm.weight),
            ("hnorm.weight", self.hnorm.weight),
            ("eh_proj.weight", self.eh_proj.weight),
            ("shared_head.norm.weight", self.shared_head_norm.weight),
        ):
            load_param(param, take, self.prefix + name)
        self.layer.load(take, self.prefix)


def build(
    config: DeepseekV3Config,
    weights: WeightReader,
    *,
    dtype: torch.dtype,
    device: torch.device,
    target: Target | None = None,
) -> MultiTokenPredictor:
    """The :mod:`tandem.models.loading` builder: the MTP draft from the first layer after ``num_hidden_layers``, in
    the target's layout (its ``shard``: only this rank's part of the layer is read).

    Every tensor outside ``model.layers.{L}.`` is left alone (the target's, or further MTP layers).
    """
    if target is None:
        raise ValueError("the MTP draft shares the target's embedding and head: pass the target")
    shard = getattr(target, "shard", SINGLE)
    draft = MultiTokenPredictor(config, target, dtype=dtype, device="meta", shard=shard).to_empty(device=device)
    if draft.prefix + "eh_proj.weight" not in weights:
        raise CheckpointError(
            f"{weights.path}: no MTP layer ({draft.prefix}eh_proj.weight missing; "
            f"num_nextn_predict_layers={config.num_nextn_predict_layers})"
        )
    draft.load(weights.take)
    prefix = draft.prefix.replace(".", r"\.")
    shared = [rf"{prefix}embed_tokens\.", rf"{prefix}shared_head\.head\."]  # the target's, which the draft uses
    weights.finish(ignore=[rf"(?!{prefix})", *shared, *draft.layer.foreign_keys(draft.prefix)])
    return draft.eval().requires_grad_(False)
