"""The EAGLE-3 and EAGLE-1 draft heads as trained: transformers' Llama layers, keys as published.

A head turns the pair (depth-0 feature at p-1, token x_p) into the pre-norm output g_p, chained by
:mod:`tandem.training.ttt`. It is built from the target's Hugging Face config and warm-start
tensors (its final norm and head), so the same head trains against transformers' model (the demo
trainer) or tandem's own provider (:mod:`tandem.training.trainer`). Its ``state_dict`` (less the
rotary tables) is the published checkpoint that :mod:`tandem.models.drafts.eagle3` /
:mod:`~tandem.models.drafts.eagle` load, and the peers' loaders read.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import Cache, LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from tandem.training.vocab import DraftVocab

EAGLE3_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # like the published Llama-3.1 EAGLE-3 drafts
ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "eagle": "LlamaForCausalLMEagle"}  # what loaders dispatch on


class TargetHead(Protocol):
    """What a head reads from its target at train time: ``lm_head(g [.., H]) -> [.., V]`` (no final norm)."""

    def lm_head(self, hidden: Tensor) -> Tensor: ...


class DraftHead(Protocol):
    """A trainable draft head; ``hidden_kind`` says which target features it reads ("aux" | "last")."""

    hidden_kind: str
    rotary: nn.Module

    def features(self, captured: Tensor) -> Tensor:
        """The target's captured features ``[B, T, *]`` -> the depth-0 hidden ``[B, T, H]``."""
        ...

    def layer(self, embeds: Tensor, hidden: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: Cache) -> Tensor:
        """``[B, N, H]`` embeddings and hidden inputs -> the pre-norm outputs g ``[B, N, H]``. The layer's
        keys and values are appended to ``cache``; its queries see the cached ones where ``mask [1, 1, N, K]``
        (additive) allows."""
        ...

    def logits(self, g: Tensor, target: TargetHead) -> Tensor:
        """``g [..., H]`` -> logits ``[..., draft_V]``."""
        ...


class SiblingHead(nn.Module):
    """A draft saved as its own directory beside the target (EAGLE-1, EAGLE-3): ``config`` is what it
    was built from and is saved with it; its weights are every parameter (the embedding and any shared
    head are the target's, the rotary tables are not weights)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config

    def state(self) -> dict[str, Tensor]:
        return {name: t for name, t in self.state_dict().items() if not name.startswith("rotary.")}


class Eagle3Head(SiblingHead):
    """EAGLE-3's draft (``fc``, ``midlayer.*``, ``norm``, ``lm_head [draft_V, H]``); reads the concatenated
    aux hidden states ``[B, T, 3 * Ht]``."""

    hidden_kind = "aux"

    def __init__(self, config: LlamaConfig, norm: Tensor, head: Tensor, vocab: DraftVocab | None = None):
        super().__init__(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.vocab = vocab
        num_aux = len(config.eagle_config["eagle_aux_hidden_state_layer_ids"])
        self.fc = nn.Linear(num_aux * config.target_hidden_size, hidden, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = LlamaRMSNorm(hidden, eps)
        self.midlayer.hidden_norm = LlamaRMSNorm(hidden, eps)
        attention = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads cat(embedding, hidden): 2H
            setattr(attention, name, nn.Linear(2 * hidden, getattr(attention, name).out_features, bias=False))
        self.midlayer.self_attn = attention
        self.midlayer.post_attention_layernorm = LlamaRMSNorm(hidden, eps)
        self.midlayer.mlp = LlamaMLP(config)
        self.norm = LlamaRMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        with torch.no_grad():  # start from the target's head: the draft predicts the same tokens
            self.norm.weight.copy_(norm)
            self.lm_head.weight.copy_(head if vocab is None else head[vocab.token_ids.to(head.device)])

    def features(self, captured: Tensor) -> Tensor:
        return self.fc(captured)

    def layer(self, embeds: Tensor, hidden: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: Cache) -> Tensor:
        layer = self.midlayer  # the residual is `hidden`, not the attention input
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        hidden = hidden + layer.self_attn(x, rope, mask, cache=cache)[0]
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, g: Tensor, target: TargetHead) -> Tensor:
        return self.lm_head(self.norm(g))

    def state(self) -> dict[str, Tensor]:
        """The weights, plus ``d2t``/``t2d`` when the draft vocabulary is reduced."""
        tensors = super().state()
        if self.vocab is not None:
            tensors |= {"d2t": self.vocab.d2t, "t2d": self.vocab.t2d}
        return tensors


class EagleHead(SiblingHead):
    """EAGLE-1's draft (``fc``, ``layers.0.*`` without ``input_layernorm``); reads the target's last hidden
    state after its final norm and predicts through the target's own head."""

    hidden_kind = "last"

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # the fc output enters attention unnormed
        self.layers = nn.ModuleList([layer])
        self.rotary = LlamaRotaryEmbedding(config)

    def features(self, captured: Tensor) -> Tensor:
        return captured

    def layer(self, embeds: Tensor, hidden: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: Cache) -> Tensor:
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        return self.layers[0](x, attention_mask=mask, position_embeddings=rope, cache=cache)

    def logits(self, g: Tensor, target: TargetHead) -> Tensor:
        return target.lm_head(g)  # no norm: g feeds the target's head as it is


def one_layer_config(target: PretrainedConfig, architecture: str, **fields: Any) -> LlamaConfig:
    """A draft's config: one Llama layer of the target's shape, plus the draft kind's own ``fields``."""
    config = LlamaConfig(
        architectures=[architecture],
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads,
        vocab_size=target.vocab_size,
        rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=target.max_position_embeddings,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        **fields,
    )
    config._attn_implementation = "sdpa"  # the TTT mask is a 4-D additive mask: any dense kernel takes it
    return config


def eagle3_config(target: PretrainedConfig, aux_layer_ids: tuple[int, ...], draft_vocab_size: int) -> LlamaConfig:
    """EAGLE-3's config: its own RoPE, the draft vocabulary size, the capture points ``aux_layer_ids``
    (HF ``hidden_states`` indices, as :attr:`tandem.models.base.Target.aux_layer_ids`)."""
    return one_layer_config(
        target,
        ARCHITECTURES["eagle3"],
        rope_parameters=dict(EAGLE3_ROPE),
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target.hidden_size,
        # SGLang/SpecForge convention: id i = the output of target layer i = HF hidden_states index i + 1.
        eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layer_ids]},
    )


def eagle_config(target: PretrainedConfig) -> LlamaConfig:
    """EAGLE-1's config: the target's RoPE, no ``fc`` bias (the Llama-3 drafts')."""
    return one_layer_config(target, ARCHITECTURES["eagle"], rope_parameters=dict(target.rope_parameters), bias=False)
