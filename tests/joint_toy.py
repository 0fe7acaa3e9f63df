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

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lerobot_mg.policies.base import PreTrainedPolicy

KV = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Sizes:
    """The dimensions of :class:`ToyJointPolicy`. :data:`PI0_SIZES` gives exactly the parameters of full-size pi0."""

    num_layers: int = 2
    vlm_width: int = 16
    vlm_mlp: int = 32
    expert_width: int = 8
    expert_mlp: int = 16
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 4
    vocab: int = 32
    patch_dim: int = 6  # flattened pixels of one patch
    num_patches: int = 3
    vision_width: int = 12
    vision_mlp: int = 24
    vision_heads: int = 2
    vision_layers: int = 2
    max_action_dim: int = 3
    max_state_dim: int = 3
    chunk: int = 4
    num_steps: int = 2
    num_tokens: int = 5  # language tokens of a batch


# PaliGemma (Gemma 2B, SigLIP So400m/14 at 224 px) with a Gemma-300M action expert, as LeRobot 0.6.1 builds pi0.
PI0_SIZES = Sizes(num_layers=18, vlm_width=2048, vlm_mlp=16384, expert_width=1024, expert_mlp=4096, heads=8,
                  kv_heads=1, head_dim=256, vocab=257152, patch_dim=3 * 14 * 14, num_patches=256, vision_width=1152,
                  vision_mlp=4304, vision_heads=16, vision_layers=27, max_action_dim=32, max_state_dim=32, chunk=50,
                  num_steps=10, num_tokens=48)


def _split(x_BTD: Tensor, heads: int) -> Tensor:
    batch, tokens, width = x_BTD.shape
    return x_BTD.view(batch, tokens, heads, width // heads).transpose(1, 2)  # (B, H, T, hd)


def _merge(x_BHTd: Tensor) -> Tensor:
    batch, heads, tokens, head_dim = x_BHTd.shape
    return x_BHTd.transpose(1, 2).reshape(batch, tokens, heads * head_dim)


class ToyRMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ToyAttention(nn.Module):
    def __init__(self, width: int, sizes: Sizes) -> None:
        super().__init__()
        self.heads, self.kv_heads = sizes.heads, sizes.kv_heads
        self.q_proj = nn.Linear(width, sizes.heads * sizes.head_dim, bias=False)
        self.k_proj = nn.Linear(width, sizes.kv_heads * sizes.head_dim, bias=False)
        self.v_proj = nn.Linear(width, sizes.kv_heads * sizes.head_dim, bias=False)
        self.o_proj = nn.Linear(sizes.heads * sizes.head_dim, width, bias=False)


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

    def __init__(self, width: int, hidden: int, sizes: Sizes) -> None:
        super().__init__()
        self.input_layernorm = ToyRMSNorm(width)
        self.self_attn = ToyAttention(width, sizes)
        self.post_attention_layernorm = ToyRMSNorm(width)
        self.mlp = ToyMLP(width, hidden)

    def _qkv(self, x_BTW: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = self.input_layernorm(x_BTW)
        attn = self.self_attn
        return (_split(attn.q_proj(h), attn.heads), _split(attn.k_proj(h), attn.kv_heads),
                _split(attn.v_proj(h), attn.kv_heads))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        repeat = self.self_attn.heads // self.self_attn.kv_heads
        return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1))

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
        return self._finish(suffix, self._attend(q, keys, values))


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
        prefix_out = self._finish(prefix, self._attend(q, k, v))
        return prefix_out, expert(suffix, (k, v)), (k, v)


class ToyVisionAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.k_proj, self.v_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.q_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (_split(proj(x), self.heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(_merge(F.scaled_dot_product_attention(q, k, v)))


class ToyVisionMLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class ToyVisionLayer(nn.Module):
    """SigLIP's encoder layer, by its names."""

    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(sizes.vision_width)
        self.self_attn = ToyVisionAttention(sizes.vision_width, sizes.vision_heads)
        self.layer_norm2 = nn.LayerNorm(sizes.vision_width)
        self.mlp = ToyVisionMLP(sizes.vision_width, sizes.vision_mlp)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ToyVisionTower(nn.Module):
    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(sizes.patch_dim, sizes.vision_width)  # SigLIP's conv, as a matrix
        self.position_embedding = nn.Embedding(sizes.num_patches, sizes.vision_width)
        self.layers = nn.ModuleList(ToyVisionLayer(sizes) for _ in range(sizes.vision_layers))
        self.post_layernorm = nn.LayerNorm(sizes.vision_width)

    def forward(self, patches: Tensor) -> Tensor:
        x = self.patch_embedding(patches) + self.position_embedding.weight[: patches.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


class _Holder(nn.Module):
    """A container with LeRobot's path segment names (``model``, ``encoder``, ...) and no forward."""


class ToyJointPolicy(nn.Module):
    """The protocol in miniature (or, with :data:`PI0_SIZES` on the meta device, pi0's shapes and parameter count).
    ``forward(batch) -> (loss, logs)``; ``predict_action_chunk`` runs the prefix-only pass then ``num_steps``
    suffix passes."""

    _fsdp_wrap_modules: ClassVar[list[str]] = ["ToyVisionLayer"]
    _checkpoint_modules: ClassVar[list[str]] = ["ToyVLMLayer"]
    freeze_unused_parameters = PreTrainedPolicy.freeze_unused_parameters

    def __init__(self, sizes: Sizes = Sizes()) -> None:
        super().__init__()
        self.sizes = sizes
        self.chunk, self.action_dim, self.num_steps = sizes.chunk, sizes.max_action_dim, sizes.num_steps
        self.model = _Holder()
        pwe = self.model.paligemma_with_expert = _Holder()
        paligemma = pwe.paligemma = _Holder()
        paligemma.model = _Holder()
        paligemma.model.vision_tower = ToyVisionTower(sizes)
        paligemma.model.multi_modal_projector = nn.Linear(sizes.vision_width, sizes.vlm_width)
        language = paligemma.model.language_model = _Holder()
        language.embed_tokens = nn.Embedding(sizes.vocab, sizes.vlm_width)
        language.layers = nn.ModuleList(ToyVLMLayer(sizes.vlm_width, sizes.vlm_mlp, sizes)
                                        for _ in range(sizes.num_layers))
        language.norm = ToyRMSNorm(sizes.vlm_width)
        paligemma.lm_head = nn.Linear(sizes.vlm_width, sizes.vocab, bias=False)  # built and saved, never read
        expert = pwe.gemma_expert = _Holder()
        expert.model = _Holder()
        expert.model.layers = nn.ModuleList(ToyExpertLayer(sizes.expert_width, sizes.expert_mlp, sizes)
                                            for _ in range(sizes.num_layers))
        expert.model.norm = ToyRMSNorm(sizes.expert_width)
        expert.lm_head = nn.Linear(sizes.expert_width, sizes.vocab, bias=False)
        width = sizes.expert_width
        self.model.state_proj = nn.Linear(sizes.max_state_dim, width)
        self.model.action_in_proj = nn.Linear(sizes.max_action_dim, width)
        self.model.action_out_proj = nn.Linear(width, sizes.max_action_dim)
        self.model.action_time_mlp_in = nn.Linear(2 * width, width)
        self.model.action_time_mlp_out = nn.Linear(width, width)

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

    def example_batch(self, batch_size: int) -> dict[str, Tensor]:
        """Zeros on the current default device (the memory plan's activation estimate makes them on meta)."""
        sizes = self.sizes
        return {"images": torch.zeros(batch_size, sizes.num_patches, sizes.patch_dim),
                "tokens": torch.zeros(batch_size, sizes.num_tokens, dtype=torch.long),
                "state": torch.zeros(batch_size, sizes.max_state_dim),
                "noise": torch.zeros(batch_size, sizes.chunk, sizes.max_action_dim),
                "time": torch.full((batch_size,), 0.5),
                "action": torch.zeros(batch_size, sizes.chunk, sizes.max_action_dim)}

    # --- the passes -------------------------------------------------------------------------------------------

    def embed_prefix(self, batch: dict[str, Tensor]) -> Tensor:
        paligemma = self.model.paligemma_with_expert.paligemma.model
        images = paligemma.multi_modal_projector(paligemma.vision_tower(batch["images"]))
        words = paligemma.language_model.embed_tokens(batch["tokens"])
        return torch.cat([images, words], dim=1)

    def embed_suffix(self, state: Tensor, noisy_actions: Tensor, time: Tensor) -> Tensor:
        width = self.sizes.expert_width
        frequencies = torch.exp(torch.arange(width // 2, device=time.device) * (-4.0 / width))
        angles = time[:, None] * frequencies[None]
        time_BW = torch.cat([angles.sin(), angles.cos()], dim=-1)
        actions = self.model.action_in_proj(noisy_actions)
        fused = torch.cat([actions, time_BW[:, None].expand_as(actions)], dim=-1)
        actions = self.model.action_time_mlp_out(F.silu(self.model.action_time_mlp_in(fused)))
        return torch.cat([self.model.state_proj(state)[:, None], actions], dim=1)

    def joint(self, prefix: Tensor | None, suffix: Tensor | None,
              cache: list[KV] | None = None) -> tuple[Tensor | None, Tensor | None, list[KV]]:
        """Every joint layer, both forwards each (the VLM layer calls the expert layer)."""
        filled = []
        for i, (vlm, expert) in enumerate(zip(self.vlm_layers, self.expert_layers)):
            prefix, suffix, kv = vlm(prefix, suffix, expert, None if cache is None else cache[i])
            filled.append(kv)
        return prefix, suffix, filled

    def velocity(self, suffix_out: Tensor) -> Tensor:
        normed = self.model.paligemma_with_expert.gemma_expert.model.norm(suffix_out[:, 1:])
        return self.model.action_out_proj(normed)

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Flow matching with the batch's own noise and time: both streams in one pass."""
        noise, time, actions = batch["noise"], batch["time"], batch["action"]
        noisy = time[:, None, None] * noise + (1 - time[:, None, None]) * actions
        suffix = self.embed_suffix(batch["state"], noisy, time)
        _, suffix_out, _ = self.joint(self.embed_prefix(batch), suffix)
        loss = F.mse_loss(self.velocity(suffix_out), noise - actions)
        return loss, {"mse": loss.detach()}

    def fill_cache(self, batch: dict[str, Tensor]) -> list[KV]:
        """The prefix-only pass."""
        _, suffix, cache = self.joint(self.embed_prefix(batch), None)
        assert suffix is None
        return cache

    def denoise_step(self, cache: list[KV], state: Tensor, x: Tensor, time: Tensor) -> Tensor:
        """One suffix pass with the cached prefix: the velocity at (x, time)."""
        prefix, suffix_out, _ = self.joint(None, self.embed_suffix(state, x, time), cache)
        assert prefix is None
        return self.velocity(suffix_out)

    def predict_action_chunk(self, batch: dict[str, Tensor]) -> Tensor:
        cache = self.fill_cache(batch)
        x = batch["noise"]
        dt = -1.0 / self.num_steps
        time = torch.ones(x.shape[0], device=x.device)
        for _ in range(self.num_steps):
            x = x + dt * self.denoise_step(cache, batch["state"], x, time)
            time = time + dt
        return x


def toy_batch(seed: int, batch_size: int = 4, sizes: Sizes = Sizes()) -> dict[str, Tensor]:
    """A batch of :class:`ToyJointPolicy`, its noise and time included, from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "images": torch.randn(batch_size, sizes.num_patches, sizes.patch_dim, generator=generator),
        "tokens": torch.randint(0, sizes.vocab, (batch_size, sizes.num_tokens), generator=generator),
        "state": torch.randn(batch_size, sizes.max_state_dim, generator=generator),
        "noise": torch.randn(batch_size, sizes.chunk, sizes.max_action_dim, generator=generator),
        "time": torch.rand(batch_size, generator=generator) * 0.9 + 0.05,
        "action": torch.randn(batch_size, sizes.chunk, sizes.max_action_dim, generator=generator),
    }
