"""SmolVLM with an action expert beside it, layer by layer: the two streams SmolVLA's joint attention mixes.

The VLM stream (the prefix: image, language and state tokens) runs through the first ``num_vlm_layers`` language
layers of SmolVLM; the expert stream (the suffix: the noisy action chunk with its time) runs through a narrower
Llama stack of the same depth. Joint layer i is VLM layer i and expert layer i:

* a **self-attention** layer attends over both streams at once (keys and values of the prefix and the suffix
  concatenated, each stream projected by its own layer);
* a **cross-attention** layer (``attention_mode="cross_attn"``, every index that is not a multiple of
  ``self_attn_every_n_layers``) lets the prefix attend to itself, while the expert's queries attend only to the
  prefix: the VLM's keys and values (after RoPE) projected by the expert's own ``k_proj``/``v_proj``, with the
  expert's positions restarting at 0.

Each joint layer is computed by calling VLM layer i, whose forward calls expert layer i's forward (handing it an
:class:`ExpertAttention`, the attention the VLM layer owns): both forwards run in every pass, so a parallelism
wrapper that gathers and frees a layer's weights around its forward (FSDP2's grouped units) sees them all. A
stream that is absent in a pass (the suffix in the prefix pass that fills the key/value cache, the prefix in each
denoising step, which reads that cache) is ``None`` and the layer returns ``None`` for it without touching its
weights. The state_dict names are LeRobot 0.6.1's (``vlm.model.text_model.layers.i.self_attn.q_proj``, ...).

The arithmetic is LeRobot's: RoPE with max wavelength 10,000 whatever the VLM's ``rope_theta`` says, eager attention
in float32 with grouped key/value heads, residuals added in place in the layer's dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, SmolVLMConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

# SmolVLA's rotary embedding, as LeRobot applies it to both streams (not the VLM's rope_theta).
ROPE_MAX_WAVELENGTH = 10_000
# Key/value cache of the prefix: per layer, keys and values after RoPE, (B, L_prefix, kv_heads, head_dim).
KVCache = list[tuple[Tensor, Tensor]]


def apply_rope(x: Tensor, positions: Tensor, max_wavelength: float = ROPE_MAX_WAVELENGTH) -> Tensor:
    """Rotate (B, L, H, D) ``x`` by positions (B, L): the first and second halves of each head are the two
    coordinates of D/2 rotations, at wavelengths growing geometrically to ``max_wavelength``. Computed in
    float32, returned in ``x``'s dtype."""
    half = x.shape[-1] // 2
    dtype = x.dtype
    x = x.to(torch.float32)
    exponents = (2.0 / x.shape[-1]) * torch.arange(half, dtype=torch.float32, device=x.device)
    timescale = max_wavelength**exponents
    radians = (positions[..., None].to(torch.float32) / timescale[None, None, :])[..., None, :]
    sin, cos = torch.sin(radians), torch.cos(radians)
    first, second = x.split(half, dim=-1)
    rotated = torch.empty_like(x)
    rotated[..., :half] = first * cos - second * sin
    rotated[..., half:] = second * cos + first * sin
    return rotated.to(dtype)


def expert_intermediate_size(hidden: int, ffn_multiplier: int = 4, multiple_of: int = 256) -> int:
    """The expert's MLP width for its width ``hidden``: LeRobot's rule, 4 x 2/3 x hidden rounded up to 256."""
    width = int(ffn_multiplier * int(2 * hidden / 3))
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


def eager_attention(queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor, num_heads: int) -> Tensor:
    """Softmax attention of (B, Lq, H, D) queries over (B, Lk, KVH, D) keys and values, each key/value head shared
    by H / KVH query heads; ``mask`` (B, Lq, Lk) bool says which keys a query sees. Scores and softmax in float32;
    the probabilities take the values' dtype. Returns (B, Lq, H * D)."""
    batch, key_length, kv_heads, head_dim = keys.shape
    groups = num_heads // kv_heads
    keys = keys[:, :, :, None, :].expand(batch, key_length, kv_heads, groups, head_dim)
    keys = keys.reshape(batch, key_length, kv_heads * groups, head_dim)
    values = values[:, :, :, None, :].expand(batch, key_length, kv_heads, groups, head_dim)
    values = values.reshape(batch, key_length, kv_heads * groups, head_dim)
    queries = queries.to(torch.float32).transpose(1, 2)
    keys = keys.to(torch.float32).transpose(1, 2)
    scores = torch.matmul(queries, keys.transpose(2, 3))
    scores *= head_dim**-0.5
    scores = torch.where(mask[:, None, :, :], scores, torch.finfo(torch.float32).min)
    probabilities = nn.functional.softmax(scores, dim=-1).to(dtype=values.dtype)
    output = torch.matmul(probabilities, values.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
    return output.reshape(batch, -1, kv_heads * groups * head_dim)


class SmolVLASelfAttention(nn.Module):
    """The q/k/v/o projections of one decoder layer (LeRobot's names); its layer's forward uses them.

    ``kv_input_size`` is the width the keys and values are projected from: the layer's own width, or in an expert
    cross-attention layer the VLM's key/value width (the expert projects the VLM's keys and values)."""

    def __init__(self, config: LlamaConfig, kv_input_size: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(kv_input_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(kv_input_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)

    def heads(self, projection: nn.Linear, hidden: Tensor) -> Tensor:
        """``projection(hidden)`` split into heads: (B, L, heads, head_dim)."""
        return projection(hidden).view(*hidden.shape[:-1], -1, self.head_dim)


class _DecoderLayer(nn.Module):
    """What both streams' layers hold: LeRobot's (Llama's) submodule names and order."""

    def __init__(self, config: LlamaConfig, kv_input_size: int) -> None:
        super().__init__()
        self.self_attn = SmolVLASelfAttention(config, kv_input_size)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _normed(self, hidden: Tensor) -> Tensor:
        return self.input_layernorm(hidden).to(dtype=self.self_attn.q_proj.weight.dtype)

    def _finish(self, hidden: Tensor, attention: Tensor) -> Tensor:
        """Output projection, residual, MLP, residual (LeRobot's order, the residuals added in place)."""
        out = self.self_attn.o_proj(attention.to(self.self_attn.o_proj.weight.dtype))
        out += hidden
        residual = out.clone()
        out = self.mlp(self.post_attention_layernorm(out))
        out += residual
        return out


@dataclass
class ExpertAttention:
    """What VLM layer i hands expert layer i: the prefix's keys and values of this layer (after RoPE, computed in
    this pass or read from the cache; before RoPE in a training pass of a self-attention layer, whose expert does
    not read them) and ``attend(queries, keys, values)``, which applies the expert's positions
    and runs the attention the layer kind calls for, returning the expert's (B, L_suffix, H * D) output."""

    prefix_keys: Tensor
    prefix_values: Tensor
    attend: Callable[[Tensor, Tensor, Tensor], Tensor]


class SmolVLAExpertLayer(_DecoderLayer):
    """Expert decoder layer i. In a cross-attention layer its k_proj/v_proj project the VLM's keys and values
    (LeRobot creates them as plain float32 ``nn.Linear``, whatever dtype the expert is built in)."""

    def __init__(self, config: LlamaConfig, cross_attention: bool, vlm_kv_width: int) -> None:
        super().__init__(config, vlm_kv_width if cross_attention else config.hidden_size)
        self.cross_attention = cross_attention

    def forward(self, hidden: Tensor | None, attention: ExpertAttention) -> Tensor | None:
        """The suffix after this layer, or None when the pass has no suffix (the weights are not touched)."""
        if hidden is None:
            return None
        attn = self.self_attn
        normed = self._normed(hidden)
        queries = attn.heads(attn.q_proj, normed)
        if self.cross_attention:
            keys = attn.heads(attn.k_proj, _flat_heads(attention.prefix_keys, attn.k_proj.weight.dtype))
            values = attn.heads(attn.v_proj, _flat_heads(attention.prefix_values, attn.v_proj.weight.dtype))
        else:
            keys, values = attn.heads(attn.k_proj, normed), attn.heads(attn.v_proj, normed)
        return self._finish(hidden, attention.attend(queries, keys, values))


def _flat_heads(states: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, L, heads, D) -> (B, L, heads * D) in ``dtype``."""
    return states.to(dtype=dtype).reshape(*states.shape[:2], -1)


class SmolVLAVLMLayer(_DecoderLayer):
    """VLM language decoder layer i; its forward computes joint layer i, calling expert layer i inside."""

    def __init__(self, config: LlamaConfig, cross_attention: bool) -> None:
        super().__init__(config, config.hidden_size)
        self.cross_attention = cross_attention
        self.num_heads = config.num_attention_heads

    def forward(
        self,
        prefix: Tensor | None,
        suffix: Tensor | None,
        expert: SmolVLAExpertLayer,
        attention_mask: Tensor,
        position_ids: Tensor,
        cached: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None]:
        """(prefix out, suffix out, this layer's prefix keys and values after RoPE in the prefix-only pass, which
        fills the cache; None in the passes with a suffix, so that activation checkpointing keeps nothing extra).

        ``attention_mask`` (B, Lq, Lk) bool and ``position_ids`` (B, Lq) cover the tokens of the streams present,
        prefix first; with ``cached`` (the prefix pass's keys and values) the prefix is None and the keys run
        over [prefix; suffix]. Expert layer i's forward runs inside, also when the suffix is None."""
        num_heads = self.num_heads
        # Training through a self-attention layer: one attention over both streams (their queries concatenated).
        joint = prefix is not None and suffix is not None and not self.cross_attention
        if prefix is not None:
            prefix_length = prefix.shape[1]
            prefix_positions = position_ids[:, :prefix_length]
            normed = self._normed(prefix)
            attn = self.self_attn
            prefix_queries = attn.heads(attn.q_proj, normed)
            prefix_keys = attn.heads(attn.k_proj, normed)
            prefix_values = attn.heads(attn.v_proj, normed)
            if not joint:  # a joint pass rotates both streams at once below (RoPE is per token: the same numbers)
                prefix_queries = apply_rope(prefix_queries, prefix_positions)
                prefix_keys = apply_rope(prefix_keys, prefix_positions)
        elif cached is None:
            raise ValueError("a pass without the prefix needs the prefix pass's keys and values (cached)")
        else:
            prefix_keys, prefix_values = cached
        prefix_attention: list[Tensor] = []

        def attend(expert_queries: Tensor, expert_keys: Tensor, expert_values: Tensor) -> Tensor:
            suffix_length = expert_queries.shape[1]
            suffix_positions = position_ids[:, -suffix_length:]
            suffix_mask = attention_mask[:, -suffix_length:]
            if self.cross_attention:  # the prefix's keys only, the expert's positions from 0
                suffix_positions = suffix_positions - torch.min(suffix_positions, dim=1, keepdim=True).values
                return eager_attention(apply_rope(expert_queries, suffix_positions), expert_keys, expert_values,
                                       suffix_mask[:, :, : expert_keys.shape[1]], num_heads)
            values = torch.cat([prefix_values, expert_values], dim=1)
            if not joint:  # a denoising step: the suffix over [cached prefix; suffix]
                keys = torch.cat([prefix_keys, apply_rope(expert_keys, suffix_positions)], dim=1)
                return eager_attention(apply_rope(expert_queries, suffix_positions), keys, values, suffix_mask,
                                       num_heads)
            # Both streams' queries and keys rotated in one go, as LeRobot does (the prefix's are not rotated yet).
            queries = apply_rope(torch.cat([prefix_queries, expert_queries], dim=1), position_ids)
            keys = apply_rope(torch.cat([prefix_keys, expert_keys], dim=1), position_ids)
            output = eager_attention(queries, keys, values, attention_mask, num_heads)
            prefix_attention.append(output[:, :-suffix_length])
            return output[:, -suffix_length:]

        suffix_out = expert(suffix, ExpertAttention(prefix_keys, prefix_values, attend))
        prefix_out = None
        if prefix is not None:
            if not prefix_attention:  # the prefix attends to itself alone
                prefix_attention.append(eager_attention(
                    prefix_queries, prefix_keys, prefix_values,
                    attention_mask[:, :prefix_length, :prefix_length], num_heads,
                ))
            prefix_out = self._finish(prefix, prefix_attention[0])
        return prefix_out, suffix_out, (prefix_keys, prefix_values) if suffix is None else None


class SmolVLAText(nn.Module):
    """SmolVLM's language model cut to its first layers, with SmolVLA's joint layers (LeRobot's names)."""

    def __init__(self, config: LlamaConfig, num_layers: int, cross_layers: list[bool]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(SmolVLAVLMLayer(config, cross_layers[i]) for i in range(num_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Llama's rotary embedding, as the VLM carries it (its non-persistent buffers included); SmolVLA's layers
        # apply their own RoPE (apply_rope) instead.
        self.rotary_emb = LlamaRotaryEmbedding(config)


class SmolVLAExpert(nn.Module):
    """The action expert: a Llama stack (no token embedding) beside the VLM's layers."""

    def __init__(self, config: LlamaConfig, cross_layers: list[bool], vlm_kv_width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SmolVLAExpertLayer(config, cross, vlm_kv_width) for cross in cross_layers)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)


class SmolVLMCore(nn.Module):
    """``vlm.model``: SmolVLM's vision encoder (transformers'), connector (pixel shuffle + projection) and the
    language model."""

    def __init__(self, config: SmolVLMConfig, num_layers: int, cross_layers: list[bool]) -> None:
        super().__init__()
        self.vision_model = SmolVLMVisionTransformer(config.vision_config)
        self.connector = SmolVLMConnector(config)
        self.text_model = SmolVLAText(config.text_config, num_layers, cross_layers)


class SmolVLM(nn.Module):
    """``vlm``: the VLM as LeRobot keeps it, its language head included (in the checkpoint, never used)."""

    def __init__(self, config: SmolVLMConfig, num_layers: int, cross_layers: list[bool]) -> None:
        super().__init__()
        self.model = SmolVLMCore(config, num_layers, cross_layers)
        text = config.text_config
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)


def expert_config(text_config: LlamaConfig, width_multiplier: float, num_layers: int) -> LlamaConfig:
    """The expert's Llama config: the VLM's language config at ``width_multiplier`` of its width, LeRobot's MLP
    width, ``num_layers`` layers."""
    config = copy.deepcopy(text_config)
    width = int(text_config.hidden_size * width_multiplier)
    config.hidden_size = width
    config.intermediate_size = expert_intermediate_size(width)
    config.num_hidden_layers = num_layers
    return config


class SmolVLMWithExpertModel(nn.Module):
    """``vlm_with_expert``: the VLM and the action expert, run layer by layer together (see the module doc)."""

    def __init__(self, vlm_config: SmolVLMConfig, num_vlm_layers: int, cross_layers: list[bool],
                 expert_width_multiplier: float) -> None:
        super().__init__()
        text = vlm_config.text_config
        self.vlm = SmolVLM(vlm_config, num_vlm_layers, cross_layers)
        self.expert_config = expert_config(text, expert_width_multiplier, num_vlm_layers)
        self.lm_expert = SmolVLAExpert(self.expert_config, cross_layers, text.num_key_value_heads * text.head_dim)
        self.vlm_config = vlm_config

    @property
    def vlm_layers(self) -> nn.ModuleList:
        return self.vlm.model.text_model.layers

    @property
    def expert_hidden_size(self) -> int:
        return self.expert_config.hidden_size

    def embed_image(self, image: Tensor) -> Tensor:
        """(B, tokens, VLM width) features of images (B, C, H, W) in [-1, 1] (vision encoder, then connector)."""
        vision = self.vlm.model.vision_model
        pixels = image.to(dtype=vision.dtype)
        if _plain_module(vision, SmolVLMVisionTransformer):
            # The vision transformer's forward with every patch real (our images are never padded), the case in
            # which transformers drops the attention mask too; its forward builds the mask on the host and reads it
            # back to find that out, waiting for the device.
            patch = vision.patch_size
            patches = torch.ones((pixels.shape[0], pixels.shape[2] // patch, pixels.shape[3] // patch),
                                 dtype=torch.bool, device=pixels.device)
            hidden = vision.embeddings(pixel_values=pixels, patch_attention_mask=patches)
            encoded = vision.encoder(inputs_embeds=hidden, attention_mask=None)
            features = vision.post_layernorm(encoded.last_hidden_state if hasattr(encoded, "last_hidden_state")
                                             else encoded[0])
        else:  # wrapped (a sharded or compiled unit, hooks): through its own forward
            features = vision(pixel_values=pixels, patch_attention_mask=None).last_hidden_state
        return self.vlm.model.connector(features)

    def embed_language_tokens(self, tokens: Tensor) -> Tensor:
        return self.vlm.model.text_model.embed_tokens(tokens)

    def forward(
        self,
        attention_mask: Tensor,
        position_ids: Tensor,
        prefix: Tensor | None,
        suffix: Tensor | None,
        cache: KVCache | None = None,
    ) -> tuple[Tensor | None, Tensor | None, KVCache]:
        """Run both streams through every joint layer and each stream's final norm: (prefix out, suffix out, the
        prefix keys and values of every layer when only the prefix ran, else an empty list). Training passes both
        streams; inference passes the prefix alone (its keys and values are the cache) and then, per denoising
        step, the suffix alone with that cache."""
        new_cache: KVCache = []
        for index, (vlm_layer, expert_layer) in enumerate(zip(self.vlm_layers, self.lm_expert.layers, strict=True)):
            prefix, suffix, layer_kv = vlm_layer(prefix, suffix, expert_layer, attention_mask, position_ids,
                                                 None if cache is None else cache[index])
            if layer_kv is not None:
                new_cache.append(layer_kv)
        prefix_out = None if prefix is None else self.vlm.model.text_model.norm(prefix)
        suffix_out = None if suffix is None else self.lm_expert.norm(suffix)
        return prefix_out, suffix_out, new_cache


def _plain_module(module: nn.Module, cls: type[nn.Module]) -> bool:
    """``module`` is exactly a ``cls``, with no hooks and not compiled: calling its parts is calling it."""
    return (type(module) is cls and not module._forward_hooks and not module._forward_pre_hooks
            and getattr(module, "_compiled_call_impl", None) is None)
