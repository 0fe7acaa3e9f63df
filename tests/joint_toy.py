"""A small vision-language-action policy that follows the joint layer protocol (``PreTrainedPolicy.fsdp_unit_groups``)
exactly as pi0, pi0.5 and SmolVLA do, for the sharding tests: a vision tower of its own layer class, a VLM stack
and an action-expert stack whose layer ``i`` attend jointly, LeRobot's submodule names, language-model heads the
loss never reads, and three kinds of pass:

- training: both streams in one pass (the suffix attends to the prefix's keys and values of the same layer);
- the prefix-only pass that fills the KV cache (``suffix=None``: the expert layers run and return ``None``);
- a suffix pass with the cached prefix (``prefix=None``: the VLM layers run and return ``None``), once per
  denoising step.

In every pass the policy calls ``vlm_layer_i(...)``, whose forward calls ``expert_layer_i(...)`` inside it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lerobot_mg.policies.base import PreTrainedPolicy

HEADS, HEAD_DIM = 2, 4
KV = tuple[Tensor, Tensor]


def _heads(x_BTD: Tensor) -> Tensor:
    batch, tokens, _ = x_BTD.shape
    return x_BTD.view(batch, tokens, HEADS, HEAD_DIM).transpose(1, 2)  # (B, H, T, hd)


def _merge(x_BHTd: Tensor) -> Tensor:
    batch, _, tokens, _ = x_BHTd.shape
    return x_BHTd.transpose(1, 2).reshape(batch, tokens, HEADS * HEAD_DIM)


class ToyRMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ToyAttention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        inner = HEADS * HEAD_DIM
        self.q_proj = nn.Linear(width, inner, bias=False)
        self.k_proj = nn.Linear(width, inner, bias=False)
        self.v_proj = nn.Linear(width, inner, bias=False)
        self.o_proj = nn.Linear(inner, width, bias=False)


class ToyMLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class ToyDecoderLayer(nn.Module):
    """Shared by both stacks: norms, projections and MLP as Gemma's decoder layer names them."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = ToyRMSNorm(width)
        self.self_attn = ToyAttention(width)
        self.post_attention_layernorm = ToyRMSNorm(width)
        self.mlp = ToyMLP(width, hidden)

    def _qkv(self, x_BTW: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = self.input_layernorm(x_BTW)
        attn = self.self_attn
        return _heads(attn.q_proj(h)), _heads(attn.k_proj(h)), _heads(attn.v_proj(h))

    def _finish(self, x_BTW: Tensor, attended: Tensor) -> Tensor:
        x_BTW = x_BTW + self.self_attn.o_proj(_merge(attended))
        return x_BTW + self.mlp(self.post_attention_layernorm(x_BTW))


class ToyExpertLayer(ToyDecoderLayer):
    """Expert layer ``i``: its suffix attends to the prefix's keys and values of layer ``i`` and to itself."""

    def forward(self, suffix: Tensor | None, prefix_kv: KV) -> Tensor | None:
        if suffix is None:
            return None
        q, k, v = self._qkv(suffix)
        keys, values = torch.cat([prefix_kv[0], k], dim=2), torch.cat([prefix_kv[1], v], dim=2)
        return self._finish(suffix, F.scaled_dot_product_attention(q, keys, values))


class ToyVLMLayer(ToyDecoderLayer):
    """VLM layer ``i``: the prefix attends to itself; then it calls expert layer ``i`` (nested), with the prefix's
    keys and values (computed now, or ``cached`` from the prefix-only pass). Returns (prefix out, suffix out, this
    layer's prefix keys and values)."""

    def forward(self, prefix: Tensor | None, suffix: Tensor | None, expert: ToyExpertLayer,
                cached: KV | None = None) -> tuple[Tensor | None, Tensor | None, KV]:
        if prefix is None:
            assert cached is not None, "a suffix pass needs the prefix's cached keys and values"
            return None, expert(suffix, cached), cached
        q, k, v = self._qkv(prefix)
        prefix_out = self._finish(prefix, F.scaled_dot_product_attention(q, k, v))
        return prefix_out, expert(suffix, (k, v)), (k, v)


class ToyVisionLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.layer_norm1(x))


class _Holder(nn.Module):
    """A container with LeRobot's path segment names (``model``, ``encoder``, ...) and no forward."""


class ToyJointPolicy(nn.Module):
    """The protocol in miniature. ``forward(batch) -> (loss, logs)``; ``predict_action_chunk`` runs the prefix-only
    pass then ``num_steps`` suffix passes."""

    _fsdp_wrap_modules: ClassVar[list[str]] = ["ToyVisionLayer"]
    _checkpoint_modules: ClassVar[list[str]] = ["ToyVLMLayer"]
    freeze_unused_parameters = PreTrainedPolicy.freeze_unused_parameters

    def __init__(self, num_layers: int = 2, vlm_width: int = 16, expert_width: int = 8, vocab: int = 32,
                 patch_dim: int = 6, action_dim: int = 3, chunk: int = 4, num_steps: int = 2) -> None:
        super().__init__()
        self.chunk, self.action_dim, self.num_steps = chunk, action_dim, num_steps
        self.model = _Holder()
        pwe = self.model.paligemma_with_expert = _Holder()
        paligemma = pwe.paligemma = _Holder()
        paligemma.model = _Holder()
        vision = paligemma.model.vision_tower = nn.Sequential()
        vision.add_module("patch_embedding", nn.Linear(patch_dim, vlm_width))
        vision.add_module("layers", nn.Sequential(*(ToyVisionLayer(vlm_width) for _ in range(2))))
        language = paligemma.model.language_model = _Holder()
        language.embed_tokens = nn.Embedding(vocab, vlm_width)
        language.layers = nn.ModuleList(ToyVLMLayer(vlm_width, 2 * vlm_width) for _ in range(num_layers))
        language.norm = ToyRMSNorm(vlm_width)
        paligemma.lm_head = nn.Linear(vlm_width, vocab, bias=False)  # built and saved, never read by the loss
        expert = pwe.gemma_expert = _Holder()
        expert.model = _Holder()
        expert.model.layers = nn.ModuleList(ToyExpertLayer(expert_width, 2 * expert_width)
                                            for _ in range(num_layers))
        expert.model.norm = ToyRMSNorm(expert_width)
        expert.lm_head = nn.Linear(expert_width, vocab, bias=False)
        self.model.action_in_proj = nn.Linear(action_dim + 1, expert_width)
        self.model.action_out_proj = nn.Linear(expert_width, action_dim)

    # --- the declarations -------------------------------------------------------------------------------------

    @property
    def vlm_layers(self) -> nn.ModuleList:
        return self.model.paligemma_with_expert.paligemma.model.language_model.layers

    @property
    def expert_layers(self) -> nn.ModuleList:
        return self.model.paligemma_with_expert.gemma_expert.model.layers

    def fsdp_unit_groups(self) -> list[tuple[nn.Module, ...]]:
        return list(zip(self.vlm_layers, self.expert_layers))

    def unused_parameter_names(self) -> list[str]:
        return ["model.paligemma_with_expert.paligemma.lm_head.weight",
                "model.paligemma_with_expert.gemma_expert.lm_head.weight"]

    # --- the passes -------------------------------------------------------------------------------------------

    def embed_prefix(self, batch: dict[str, Tensor]) -> Tensor:
        paligemma = self.model.paligemma_with_expert.paligemma.model
        images = paligemma.vision_tower(batch["images"])
        words = paligemma.language_model.embed_tokens(batch["tokens"])
        return torch.cat([images, words], dim=1)

    def embed_suffix(self, noisy_actions: Tensor, time: Tensor) -> Tensor:
        steps = time[:, None, None].expand(-1, noisy_actions.shape[1], 1)
        return self.model.action_in_proj(torch.cat([noisy_actions, steps], dim=-1))

    def joint(self, prefix: Tensor | None, suffix: Tensor | None,
              cache: list[KV] | None = None) -> tuple[Tensor | None, Tensor | None, list[KV]]:
        """Every joint layer, both forwards each (the VLM layer calls the expert layer)."""
        filled = []
        for i, (vlm, expert) in enumerate(zip(self.vlm_layers, self.expert_layers)):
            prefix, suffix, kv = vlm(prefix, suffix, expert, None if cache is None else cache[i])
            filled.append(kv)
        return prefix, suffix, filled

    def velocity(self, suffix_out: Tensor) -> Tensor:
        return self.model.action_out_proj(self.model.paligemma_with_expert.gemma_expert.model.norm(suffix_out))

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Flow matching with the batch's own noise and time: both streams in one pass."""
        noise, time, actions = batch["noise"], batch["time"], batch["action"]
        noisy = time[:, None, None] * noise + (1 - time[:, None, None]) * actions
        _, suffix_out, _ = self.joint(self.embed_prefix(batch), self.embed_suffix(noisy, time))
        loss = F.mse_loss(self.velocity(suffix_out), noise - actions)
        return loss, {"mse": loss.detach()}

    def fill_cache(self, batch: dict[str, Tensor]) -> list[KV]:
        """The prefix-only pass."""
        _, suffix, cache = self.joint(self.embed_prefix(batch), None)
        assert suffix is None
        return cache

    def denoise_step(self, cache: list[KV], x: Tensor, time: Tensor) -> Tensor:
        """One suffix pass with the cached prefix: the velocity at (x, time)."""
        prefix, suffix_out, _ = self.joint(None, self.embed_suffix(x, time), cache)
        assert prefix is None
        return self.velocity(suffix_out)

    def predict_action_chunk(self, batch: dict[str, Tensor]) -> Tensor:
        cache = self.fill_cache(batch)
        x = batch["noise"]
        dt = -1.0 / self.num_steps
        time = torch.ones(x.shape[0])
        for _ in range(self.num_steps):
            x = x + dt * self.denoise_step(cache, x, time)
            time = time + dt
        return x


def toy_batch(seed: int, batch_size: int = 4, patch_dim: int = 6, chunk: int = 4,
              action_dim: int = 3) -> dict[str, Tensor]:
    """A batch of the default :class:`ToyJointPolicy`, its noise and time included, from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "images": torch.randn(batch_size, 3, patch_dim, generator=generator),
        "tokens": torch.randint(0, 32, (batch_size, 5), generator=generator),
        "noise": torch.randn(batch_size, chunk, action_dim, generator=generator),
        "time": torch.rand(batch_size, generator=generator) * 0.9 + 0.05,
        "action": torch.randn(batch_size, chunk, action_dim, generator=generator),
    }
