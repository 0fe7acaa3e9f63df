"""PaliGemma with an action expert: the network pi0 and pi0.5 share, with LeRobot 0.6.1's state-dict names.

``paligemma`` is PaliGemma (a SigLIP vision tower, a linear projector into the language model, a Gemma language
model and its language head, which the policy never uses but keeps so that checkpoints stay LeRobot's), and
``gemma_expert`` the action expert (a smaller Gemma without token embeddings, whose language head is kept
likewise). Their layers pair into joint layers (see :mod:`lerobot_mg.policies.vla.gemma`); the vision tower is
transformers' ``SiglipVisionModel`` (it does not take part in the joint attention).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from lerobot_mg.config.pi0 import GemmaDims, SiglipDims
from lerobot_mg.policies.vla.gemma import (
    ExpertDecoderLayer,
    GemmaStack,
    GemmaWithHead,
    JointPassInputs,
    VLMDecoderLayer,
    init_gemma_weights,
)
from lerobot_mg.policies.vla.joint import KeyValue

# Parameters LeRobot keeps in float32 in its bfloat16 build (substrings of names under paligemma_with_expert).
FLOAT32_IN_BFLOAT16 = ("vision_tower", "multi_modal_projector", "input_layernorm", "post_attention_layernorm",
                       "model.norm")
# The vision tower's repeated block: the FSDP unit of the vision side.
SIGLIP_LAYER_CLASS = "SiglipEncoderLayer"


class SiglipVisionTower(nn.Module):
    """``vision_model``: transformers' SigLIP vision encoder without its pooling head (PaliGemma's)."""

    def __init__(self, dims: SiglipDims, image_size: int) -> None:
        super().__init__()
        config = SiglipVisionConfig(
            hidden_size=dims.hidden_size, intermediate_size=dims.intermediate_size,
            num_hidden_layers=dims.num_hidden_layers, num_attention_heads=dims.num_attention_heads,
            image_size=image_size, patch_size=dims.patch_size, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
            vision_use_head=False, projection_dim=dims.projection_dim,
        )
        config._attn_implementation = "sdpa"
        self.vision_model = SiglipVisionModel(config)

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.vision_model(pixel_values).last_hidden_state


class PaliGemmaMultiModalProjector(nn.Module):
    def __init__(self, vision_width: int, projection_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(vision_width, projection_dim, bias=True)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(features)


class PaliGemmaModel(nn.Module):
    """``vision_tower``, ``multi_modal_projector``, ``language_model``."""

    def __init__(self, vlm: GemmaDims, vision: SiglipDims, image_size: int, vocab_size: int) -> None:
        super().__init__()
        self.vision_tower = SiglipVisionTower(vision, image_size)
        self.multi_modal_projector = PaliGemmaMultiModalProjector(vision.hidden_size, vision.projection_dim)
        self.language_model = GemmaStack(VLMDecoderLayer, width=vlm.width, depth=vlm.depth, mlp_dim=vlm.mlp_dim,
                                         num_heads=vlm.num_heads, num_kv_heads=vlm.num_kv_heads,
                                         head_dim=vlm.head_dim, vocab_size=vocab_size)


class PaliGemma(nn.Module):
    """``lm_head`` (unused, kept for LeRobot) and ``model``."""

    def __init__(self, vlm: GemmaDims, vision: SiglipDims, image_size: int, vocab_size: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(vlm.width, vocab_size, bias=False)
        self.model = PaliGemmaModel(vlm, vision, image_size, vocab_size)


class PaliGemmaWithExpertModel(nn.Module):
    """The two stacks and the passes through them.

    ``expert_adarms``: the expert's norms are adaptive (pi0.5: conditioned on the time embedding).
    ``dtype``: "float32", or "bfloat16" as LeRobot casts it (see :meth:`to_bfloat16_for_selected_params`)."""

    def __init__(self, vlm: GemmaDims, expert: GemmaDims, vision: SiglipDims, *, image_size: int, vocab_size: int,
                 expert_adarms: bool, dtype: str, freeze_vision_encoder: bool, train_expert_only: bool) -> None:
        super().__init__()
        self.freeze_vision_encoder = freeze_vision_encoder
        self.train_expert_only = train_expert_only
        self.paligemma = PaliGemma(vlm, vision, image_size, vocab_size)
        expert_stack = GemmaStack(ExpertDecoderLayer, width=expert.width, depth=expert.depth, mlp_dim=expert.mlp_dim,
                                  num_heads=expert.num_heads, num_kv_heads=expert.num_kv_heads,
                                  head_dim=expert.head_dim, vocab_size=None,
                                  cond_dim=expert.width if expert_adarms else None)
        self.gemma_expert = GemmaWithHead(expert_stack, vocab_size, expert.width)
        if vlm.depth != expert.depth:
            raise ValueError(f"the VLM has {vlm.depth} layers and the expert {expert.depth}: joint layers pair them")
        init_gemma_weights(self.paligemma.lm_head)
        init_gemma_weights(self.paligemma.model.language_model)
        init_gemma_weights(self.gemma_expert)
        self.to_bfloat16_for_selected_params(dtype)
        self._set_requires_grad()

    @property
    def vlm(self) -> GemmaStack:
        return self.paligemma.model.language_model

    @property
    def expert(self) -> GemmaStack:
        return self.gemma_expert.model

    def joint_layers(self) -> list[tuple[nn.Module, nn.Module]]:
        """[(VLM layer i, expert layer i)]: the joint layers, the FSDP units of the language side."""
        return list(zip(self.vlm.layers, self.expert.layers, strict=True))

    def to_bfloat16_for_selected_params(self, dtype: str) -> None:
        """float32: everything float32. bfloat16: LeRobot's build: every parameter and floating buffer in bfloat16,
        then the parameters named in :data:`FLOAT32_IN_BFLOAT16` back to float32 (the buffers stay bfloat16)."""
        if dtype == "float32":
            self.to(dtype=torch.float32)
            return
        if dtype != "bfloat16":
            raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
        self.to(dtype=torch.bfloat16)
        for name, param in self.named_parameters():
            if any(selector in name for selector in FLOAT32_IN_BFLOAT16):
                param.data = param.data.to(dtype=torch.float32)

    def _set_requires_grad(self) -> None:
        if self.freeze_vision_encoder:
            self.paligemma.model.vision_tower.requires_grad_(False)
        if self.train_expert_only:
            self.paligemma.requires_grad_(False)

    def train(self, mode: bool = True) -> PaliGemmaWithExpertModel:
        super().train(mode)
        if self.freeze_vision_encoder:
            self.paligemma.model.vision_tower.eval()
        if self.train_expert_only:
            self.paligemma.eval()
        return self

    def embed_image(self, image: Tensor) -> Tensor:
        """(B, patches, VLM width) image tokens (the vision side computes in float32; the result takes the
        image's dtype)."""
        features = self.paligemma.model.vision_tower(image.to(torch.float32))
        features = self.paligemma.model.multi_modal_projector(features)
        return features.to(image.dtype)

    def embed_language_tokens(self, tokens: Tensor) -> Tensor:
        return self.vlm.embed_tokens(tokens)

    def forward(self, prefix: Tensor | None, suffix: Tensor | None, attention_mask: Tensor, position_ids: Tensor,
                cache: list[KeyValue] | None = None, expert_cond: Tensor | None = None, fill_cache: bool = False
                ) -> tuple[Tensor | None, Tensor | None, list[KeyValue] | None]:
        """One pass through every joint layer and the final norms: (prefix out, suffix out, the prefix's keys and
        values per layer when ``fill_cache``, else None). Training gives both streams; the prefix-only pass fills
        the cache; a denoising step gives the suffix and ``cache``. ``attention_mask`` is additive (B, 1, T, S),
        ``position_ids`` (B, T) cover the tokens of this pass."""
        if prefix is not None and self.vlm.compute_dtype == torch.bfloat16:
            prefix = prefix.to(torch.bfloat16)
        if suffix is not None and self.expert.compute_dtype == torch.bfloat16:
            suffix = suffix.to(torch.bfloat16)
        rope_stack = self.vlm if prefix is not None else self.expert
        reference = prefix if prefix is not None else suffix
        if reference is None:
            raise ValueError("a pass needs the prefix, the suffix or both")
        cos, sin = rope_stack.rotary_emb(reference, position_ids)
        inputs = JointPassInputs(attention_mask, cos, sin, vlm_cond=None, expert_cond=expert_cond, fill_cache=fill_cache)
        new_cache: list[KeyValue] = []
        for index, (vlm_layer, expert_layer) in enumerate(self.joint_layers()):
            prefix, suffix, key_value = vlm_layer(prefix, suffix, expert_layer, inputs,
                                                  None if cache is None else cache[index])
            if key_value is not None:
                new_cache.append(key_value)
        prefix_out = None if prefix is None else self.vlm.norm(prefix)[0]
        suffix_out = None if suffix is None else self.expert.norm(suffix, expert_cond)[0]
        return prefix_out, suffix_out, new_cache or None
