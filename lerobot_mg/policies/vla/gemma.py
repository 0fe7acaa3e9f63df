"""Gemma decoder stacks as pi0 and pi0.5 use them, with the joint layers FSDP2 shards as one unit each.

A pi policy runs two Gemma stacks side by side: the vision-language model (PaliGemma's Gemma) over the prefix
(image and language tokens) and the action expert over the suffix (state and noisy actions). In every layer the two
streams attend jointly: their queries, keys and values are concatenated along the sequence, so the expert sees the
prefix and the prefix never sees the expert (the attention mask says so).

The joint layer protocol (every VLA of lerobot_mg follows it, see :mod:`lerobot_mg.policies.vla.joint`):

- VLM layer i (:class:`VLMDecoderLayer`) and expert layer i (:class:`ExpertDecoderLayer`) do their work in their
  own ``forward``. The VLM layer's forward calls the expert layer's forward inside it, handing it a
  :class:`JointAttention` that the expert calls once with its queries, keys and values; so both forwards run in
  every pass and the VLM's finishes last, which is what FSDP2's grouped unit ``fully_shard([vlm_i, expert_i])``
  needs to gather both before and reshard both after.
- Every pass calls both: training (both streams), the prefix-only pass that fills the key/value cache, and each
  denoising step (the suffix against the cached prefix). An absent stream is ``None``; its layer returns ``None``
  and does not touch its weights.

Numerics follow LeRobot 0.6.1 (transformers' Gemma with LeRobot's AdaRMS norm): RMSNorm scaled by ``1 + w`` in
float32, gated residuals, ``gelu_pytorch_tanh`` MLPs, RoPE with theta 10000, eager attention with a float32
softmax, token embeddings times sqrt(width) in the embedding's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from lerobot_mg.policies.vla.common import init_like_transformers
from lerobot_mg.policies.vla.joint import KeyValue

ROPE_THETA = 10_000.0
RMS_NORM_EPS = 1e-6
# Gemma's token id for padding (its embedding row receives no gradient).
GEMMA_PAD_TOKEN_ID = 0


def gated_residual(residual: Tensor, update: Tensor, gate: Tensor | None) -> Tensor:
    """``residual + update``, the update scaled by ``gate`` when the norm gave one (AdaRMS)."""
    return residual + update if gate is None else residual + update * gate


class PiGemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (scale ``1 + weight``, computed in float32), or with ``cond_dim`` the adaptive version
    (AdaRMS): a linear map ``dense`` of the condition gives scale, shift and a gate for the residual.

    ``forward(x, cond)`` returns ``(normed, gate)``; the gate is None for the plain norm."""

    def __init__(self, dim: int, eps: float = RMS_NORM_EPS, cond_dim: int | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.cond_dim = cond_dim
        if cond_dim is None:
            self.weight = nn.Parameter(torch.zeros(dim))
            self.dense = None
        else:
            self.dense = nn.Linear(cond_dim, dim * 3, bias=True)
            nn.init.zeros_(self.dense.weight)

    def _normalise(self, x: Tensor) -> Tensor:
        variance = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps)

    def forward(self, x: Tensor, cond: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        normed = self._normalise(x)
        if self.dense is None:
            return (normed * (1.0 + self.weight.float())).type_as(x), None
        if cond is None:
            raise ValueError("an adaptive RMSNorm needs its condition (the time embedding)")
        if cond.shape[-1] != self.cond_dim:
            raise ValueError(f"the AdaRMS condition has width {cond.shape[-1]}, expected {self.cond_dim}")
        modulation = self.dense(cond)
        if x.dim() == 3:
            modulation = modulation.unsqueeze(1)
        scale, shift, gate = modulation.chunk(3, dim=-1)
        normed = normed * (1 + scale.float()) + shift.float()
        return normed.to(x.dtype), gate.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}" + ("" if self.cond_dim is None else f", cond_dim={self.cond_dim}")


class GemmaMLP(nn.Module):
    """Gated MLP: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, width: int, mlp_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, mlp_dim, bias=False)
        self.up_proj = nn.Linear(width, mlp_dim, bias=False)
        self.down_proj = nn.Linear(mlp_dim, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttentionProjections(nn.Module):
    """The query, key, value and output projections of one layer's attention (grouped-query: ``num_kv_heads``
    key/value heads shared by ``num_heads`` query heads). The attention itself is joint across the streams, so it
    is computed by :class:`JointAttention`, called from the layer's forward."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(width, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, width, bias=False)


class GemmaRotaryEmbedding(nn.Module):
    """RoPE frequencies (non-persistent buffers ``inv_freq`` and ``original_inv_freq``, as transformers names
    them); ``forward(x, position_ids)`` gives (cos, sin) in x's dtype, computed in float32."""

    def __init__(self, head_dim: int, theta: float = ROPE_THETA) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        positions = position_ids[:, None, :].float()
        # Autocast off (the angles stay float32 under mixed precision); the meta device (the memory plan's shapes-only
        # forward) has no autocast and computes in float32 anyway.
        device_type = "cpu" if x.device.type in ("mps", "meta") else x.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv_freq.float() @ positions.float()).transpose(1, 2)
            angles = torch.cat((freqs, freqs), dim=-1)
            cos, sin = angles.cos(), angles.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on (B, heads, T, head_dim) with (B, T, head_dim) cos/sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


def _repeat_kv(states: Tensor, repeats: int) -> Tensor:
    if repeats == 1:
        return states
    batch, kv_heads, length, head_dim = states.shape
    return states[:, :, None].expand(batch, kv_heads, repeats, length, head_dim).reshape(
        batch, kv_heads * repeats, length, head_dim)


def eager_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """(B, T, heads * head_dim): softmax(q k^T * scaling + mask) v, the softmax in float32 then back to the query's
    dtype (transformers' eager attention, which LeRobot's pi models use)."""
    repeats = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, repeats), _repeat_kv(value, repeats)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is not None:
        weights = weights + mask[:, :, :, : key.shape[-2]]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output.reshape(output.shape[0], output.shape[1], -1)


@dataclass
class JointPassInputs:
    """What every joint layer of one pass shares: the additive attention mask (B, 1, T, S), RoPE's (cos, sin) for
    the tokens computed in this pass, the AdaRMS conditions of the two streams (None: plain norms), and whether the
    layers return the prefix's keys and values (the prefix-only pass that fills the cache)."""

    attention_mask: Tensor
    cos: Tensor
    sin: Tensor
    vlm_cond: Tensor | None = None
    expert_cond: Tensor | None = None
    fill_cache: bool = False


@dataclass
class QKV:
    query: Tensor
    key: Tensor
    value: Tensor


class JointAttention:
    """The attention of one joint layer, across the streams present in the pass.

    The VLM layer builds it with its own projections (or None when the prefix is absent) and the cached prefix
    keys/values (the denoising steps); the expert layer calls it once with its own (``__call__``, returning its
    part of the output), or the VLM layer calls :meth:`without_expert` when the suffix is absent. Afterwards
    ``prefix_output`` is the VLM's part and, in a pass that fills the cache, ``prefix_key_value`` the prefix's
    post-RoPE keys/values."""

    def __init__(self, inputs: JointPassInputs, prefix: QKV | None, cached: KeyValue | None, scaling: float) -> None:
        self.inputs = inputs
        self.prefix = prefix
        self.cached = cached
        self.scaling = scaling
        self.prefix_output: Tensor | None = None
        self.prefix_key_value: KeyValue | None = None
        self.done = False

    def __call__(self, suffix: QKV | None) -> Tensor | None:
        if self.done:
            raise RuntimeError("a joint layer's attention runs once per pass")
        self.done = True
        streams = [s for s in (self.prefix, suffix) if s is not None]
        query = torch.cat([s.query for s in streams], dim=2)
        key = torch.cat([s.key for s in streams], dim=2)
        value = torch.cat([s.value for s in streams], dim=2)
        # RoPE in the projections' dtype (already so unless a wrapper such as FSDP2's mixed precision cast the
        # layer's inputs and parameters after the pass computed cos/sin).
        cos, sin = self.inputs.cos.to(query.dtype), self.inputs.sin.to(query.dtype)
        query = apply_rotary(query, cos, sin)
        key = apply_rotary(key, cos, sin)
        prefix_length = 0 if self.prefix is None else self.prefix.query.shape[2]
        if self.inputs.fill_cache and self.prefix is not None:
            self.prefix_key_value = (KeyValue(key, value) if suffix is None else
                                     KeyValue(key[:, :, :prefix_length].clone(), value[:, :, :prefix_length].clone()))
        if self.cached is not None:
            key = torch.cat([self.cached.key, key], dim=2)
            value = torch.cat([self.cached.value, value], dim=2)
        output = eager_attention(query, key, value, self.inputs.attention_mask, self.scaling)
        if self.prefix is not None:
            self.prefix_output = output[:, :prefix_length]
        return None if suffix is None else output[:, prefix_length:]

    def without_expert(self) -> None:
        """The pass has no suffix (the prefix-only pass): attend over the prefix alone."""
        self(None)


class _GemmaDecoderLayer(nn.Module):
    """One Gemma decoder layer's weights (LeRobot's submodule names) and the two halves of its computation around
    the joint attention; the subclasses' forwards say who calls whom."""

    def __init__(self, width: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 cond_dim: int | None = None) -> None:
        super().__init__()
        self.self_attn = GemmaAttentionProjections(width, num_heads, num_kv_heads, head_dim)
        self.mlp = GemmaMLP(width, mlp_dim)
        self.input_layernorm = PiGemmaRMSNorm(width, cond_dim=cond_dim)
        self.post_attention_layernorm = PiGemmaRMSNorm(width, cond_dim=cond_dim)

    def _project(self, hidden: Tensor, cond: Tensor | None) -> tuple[QKV, Tensor | None]:
        normed, gate = self.input_layernorm(hidden, cond)
        shape = (*normed.shape[:-1], -1, self.self_attn.head_dim)
        qkv = QKV(self.self_attn.q_proj(normed).view(shape).transpose(1, 2),
                  self.self_attn.k_proj(normed).view(shape).transpose(1, 2),
                  self.self_attn.v_proj(normed).view(shape).transpose(1, 2))
        return qkv, gate

    def _finish(self, hidden: Tensor, attention: Tensor, gate: Tensor | None, cond: Tensor | None) -> Tensor:
        attention = attention.to(self.self_attn.o_proj.weight.dtype)
        hidden = gated_residual(hidden, self.self_attn.o_proj(attention), gate)
        normed, gate = self.post_attention_layernorm(hidden, cond)
        if self.mlp.up_proj.weight.dtype == torch.bfloat16:
            normed = normed.to(torch.bfloat16)
        return gated_residual(hidden, self.mlp(normed), gate)


class ExpertDecoderLayer(_GemmaDecoderLayer):
    """Expert layer i: called by VLM layer i's forward with the suffix (or None) and the joint attention."""

    def forward(self, hidden: Tensor | None, attention: JointAttention, cond: Tensor | None) -> Tensor | None:
        if hidden is None:
            return None
        qkv, gate = self._project(hidden, cond)
        return self._finish(hidden, attention(qkv), gate, cond)


class VLMDecoderLayer(_GemmaDecoderLayer):
    """VLM layer i, the outer module of joint layer i: its forward runs the prefix's half of the layer and calls
    expert layer i's forward inside it (see the module's docstring)."""

    def forward(self, prefix: Tensor | None, suffix: Tensor | None, expert_layer: ExpertDecoderLayer,
                inputs: JointPassInputs, cached: KeyValue | None = None
                ) -> tuple[Tensor | None, Tensor | None, KeyValue | None]:
        """(prefix out, suffix out, the prefix's post-RoPE keys/values when ``inputs.fill_cache``, else None): either
        stream may be None (absent); ``cached`` is the prefix's keys/values when the suffix runs against a cached
        prefix."""
        qkv, gate = (None, None) if prefix is None else self._project(prefix, inputs.vlm_cond)
        attention = JointAttention(inputs, qkv, cached, self.self_attn.scaling)
        suffix_out = expert_layer(suffix, attention, inputs.expert_cond)
        if not attention.done:
            attention.without_expert()
        prefix_out = None
        if prefix is not None:
            prefix_out = self._finish(prefix, attention.prefix_output, gate, inputs.vlm_cond)
        return prefix_out, suffix_out, attention.prefix_key_value


class GemmaScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(width) (a non-persistent ``embed_scale`` buffer, cast to the weight's dtype
    before the product, as transformers' Gemma does)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int = GEMMA_PAD_TOKEN_ID) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.register_buffer("embed_scale", torch.tensor(embedding_dim**0.5), persistent=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class GemmaStack(nn.Module):
    """A Gemma decoder: optional token embeddings, the layers, the final norm and RoPE (LeRobot's ``model.*``
    names). ``layer_class`` is :class:`VLMDecoderLayer` or :class:`ExpertDecoderLayer`."""

    def __init__(self, layer_class: type[_GemmaDecoderLayer], *, width: int, depth: int, mlp_dim: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, vocab_size: int | None, cond_dim: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = None if vocab_size is None else GemmaScaledEmbedding(vocab_size, width)
        self.layers = nn.ModuleList(
            [layer_class(width, mlp_dim, num_heads, num_kv_heads, head_dim, cond_dim) for _ in range(depth)])
        self.norm = PiGemmaRMSNorm(width, cond_dim=cond_dim)
        self.rotary_emb = GemmaRotaryEmbedding(head_dim)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the layers compute in (their projections' dtype)."""
        return self.layers[0].self_attn.q_proj.weight.dtype


class GemmaWithHead(nn.Module):
    """``lm_head`` and ``model``: a Gemma causal LM as LeRobot keeps it (the head is in the state dict, unused)."""

    def __init__(self, model: GemmaStack, vocab_size: int, width: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.model = model


def init_gemma_weights(module: nn.Module, std: float = 0.02) -> None:
    """transformers' Gemma initialisation for a freshly built stack: normal(0, std) linear and embedding weights,
    zero biases and RMSNorm weights, zero AdaRMS ``dense`` weights (a new expert starts time-independent)."""
    norms = [child for child in module.modules() if isinstance(child, PiGemmaRMSNorm)]
    for norm in norms:
        if norm.dense is None:
            nn.init.zeros_(norm.weight)
        else:
            nn.init.zeros_(norm.dense.weight)
            nn.init.zeros_(norm.dense.bias)
    init_like_transformers(module, std, skip=[norm.dense for norm in norms if norm.dense is not None])
