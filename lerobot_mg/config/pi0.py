"""pi0's configuration: the policy's hyper-parameters and the Hydra schema of ``policy=pi0`` (pi0.5's,
:mod:`lerobot_mg.config.pi05`, changes a few defaults).

The fields, their types and their defaults are LeRobot 0.6.1's ``PI0Config`` / ``PI05Config``, so a ``config.json``
written here loads in LeRobot and one written by LeRobot builds the same network here. The network's sizes come
from the variant names, as LeRobot's ``get_gemma_config`` gives them (``gemma_2b``: the PaliGemma language model,
``gemma_300m``: the action expert), and from PaliGemma's fixed vision tower (SigLIP So400m/14) and vocabulary. The
one field only lerobot_mg has, ``dimension_overrides``, replaces some of those sizes (small models for tests and
CPU runs); it lives in train_config.json, so config.json still reads as LeRobot's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lerobot_mg.config.choices import NormalizationMode
from lerobot_mg.config.policy import (
    PolicyConfig,
    check_padded_widths,
    check_positive_ints,
    empty_camera_key_names,
)
from lerobot_mg.config.recipe import TrainingPreset, flow_matching_preset
from lerobot_mg.errors import config_error

GEMMA_VARIANTS = ("gemma_300m", "gemma_2b")
PI_DTYPES = ("bfloat16", "float32")

# LeRobot's get_gemma_config: width, depth, MLP width, query heads, key/value heads, head width.
GEMMA_VARIANT_DIMS: dict[str, dict[str, int]] = {
    "gemma_300m": {"width": 1024, "depth": 18, "mlp_dim": 4096, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
    "gemma_2b": {"width": 2048, "depth": 18, "mlp_dim": 16_384, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
}
# PaliGemma's SigLIP vision tower as LeRobot builds it (projection_dim: the language model's width by default).
SIGLIP_DIMS: dict[str, int] = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
    "patch_size": 14,
}
# PaliGemma's vocabulary (also the size of the action expert's unused language head).
PALIGEMMA_VOCAB_SIZE = 257152
DEFAULT_IMAGE_SIZE = 224


def _pi0_normalization_mapping() -> dict[str, NormalizationMode]:
    return {"VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode.MEAN_STD,
            "ACTION": NormalizationMode.MEAN_STD}


def _default_image_resolution() -> list[int]:
    return [DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE]


def _default_relative_exclude_joints() -> list[str]:
    return ["gripper"]


def _default_optimizer_betas() -> list[float]:
    return [0.9, 0.95]


@dataclass(frozen=True)
class GemmaDims:
    """The sizes of one Gemma decoder stack."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class SiglipDims:
    """The sizes of the SigLIP vision tower and of its projection into the language model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    projection_dim: int


# The sections of dimension_overrides and the sizes each takes (gemma_2b and gemma_300m are the variants' stacks,
# whichever role they play).
OVERRIDE_SECTIONS: dict[str, tuple[str, ...]] = {
    **{variant: tuple(dims) for variant, dims in GEMMA_VARIANT_DIMS.items()},
    "vision": (*SIGLIP_DIMS, "projection_dim"),
    "text": ("vocab_size",),
}


def _no_dimension_overrides() -> dict[str, dict[str, int | None]]:
    # Every size present and null, so that `policy.dimension_overrides.gemma_2b.depth=2` needs no `+` and a
    # mistyped size fails at compose time.
    return {section: dict.fromkeys(names) for section, names in OVERRIDE_SECTIONS.items()}


@dataclass
class PI0Config(PolicyConfig):
    """pi0 (Black et al. 2024): PaliGemma (SigLIP + Gemma 2B) reads the cameras and the task, a Gemma 300M action
    expert attends to it jointly and predicts a chunk of actions by flow matching. LeRobot 0.6.1's fields."""

    action_length_key: ClassVar[str] = "chunk_size"
    policy_class_path: ClassVar[str] = "lerobot_mg.policies.pi0.modeling_pi0:PI0Policy"
    pads_missing_inputs: ClassVar[bool] = True
    lerobot_mg_only_fields: ClassVar[frozenset[str]] = PolicyConfig.lerobot_mg_only_fields | {"dimension_overrides", "tokenizer_name"}

    type: str = "pi0"
    n_action_steps: int = 50
    normalization_mapping: dict[str, NormalizationMode] = field(default_factory=_pi0_normalization_mapping)
    # The two Gemma stacks: the vision-language model's and the action expert's (gemma_2b or gemma_300m).
    paligemma_variant: str = "gemma_2b"
    action_expert_variant: str = "gemma_300m"
    # Parameter dtype of the vision-language model and the expert: float32, or bfloat16 as LeRobot keeps it (the
    # vision tower, its projector and every norm stay float32; the action/state/time projections too).
    dtype: str = "float32"
    # Actions predicted per chunk (openpi's action_horizon); n_action_steps of them run before the next prediction.
    chunk_size: int = 50
    # Shorter state and action vectors are zero-padded to these widths.
    max_state_dim: int = 32
    max_action_dim: int = 32
    # Flow matching: Euler steps at inference; training times ~ Beta(alpha, beta) * scale + offset; the periods of
    # the sine-cosine time embedding.
    num_inference_steps: int = 10
    time_sampling_beta_alpha: float = 1.5
    time_sampling_beta_beta: float = 1.0
    time_sampling_scale: float = 0.999
    time_sampling_offset: float = 0.001
    min_period: float = 4e-3
    max_period: float = 4.0
    # Relative actions (the processors' business: actions relative to the state, except the joints named here).
    use_relative_actions: bool = False
    relative_exclude_joints: list[str] = field(default_factory=_default_relative_exclude_joints)
    action_feature_names: list[str] | None = None
    # LeRobot's real-time chunking; not supported here (must stay null).
    rtc_config: dict[str, float | int | bool | str | None] | None = None
    # Cameras are resized with padding to this (square) size.
    image_resolution: list[int] = field(default_factory=_default_image_resolution)
    # Extra all-black cameras (masked out), for datasets with fewer cameras than the base was trained with.
    empty_cameras: int = 0
    # Recompute each joint layer (VLM layer i + expert layer i) in the backward pass, as
    # accelerator.activation_checkpointing does.
    gradient_checkpointing: bool = False
    # LeRobot's torch.compile switch; here accelerator.compile compiles each joint layer instead.
    compile_model: bool = False
    compile_mode: str = "max-autotune"
    # Fine-tuning: freeze the vision tower, or the whole vision-language model (the expert and projections train).
    freeze_vision_encoder: bool = False
    train_expert_only: bool = False
    # LeRobot's training preset (AdamW, cosine decay with warm-up), kept so that config.json round-trips.
    optimizer_lr: float = 2.5e-5
    optimizer_betas: list[float] = field(default_factory=_default_optimizer_betas)
    optimizer_eps: float = 1e-8
    optimizer_weight_decay: float = 0.01
    optimizer_grad_clip_norm: float = 1.0
    scheduler_warmup_steps: int = 1_000
    scheduler_decay_steps: int = 30_000
    scheduler_decay_lr: float = 2.5e-6
    # Language tokens per prompt (the tokenizer pads or truncates to it).
    tokenizer_max_length: int = 48

    # --- lerobot_mg only (train_config.json) ---
    # Replace some of the network's sizes, e.g. policy.dimension_overrides.gemma_2b.depth=2: gemma_2b / gemma_300m
    # {width, depth, mlp_dim, num_heads, num_kv_heads, head_dim}, vision {hidden_size, intermediate_size,
    # num_hidden_layers, num_attention_heads, patch_size, projection_dim}, text {vocab_size}. All null: LeRobot's
    # full-size network. A pretrained base's weights only load into the sizes they were saved with.
    dimension_overrides: dict[str, dict[str, int | None]] = field(default_factory=_no_dimension_overrides)
    tokenizer_name: str | None = None

    @property
    def empty_camera_keys(self) -> list[str]:
        return empty_camera_key_names(self.empty_cameras)

    @property
    def mixed_parameter_dtypes(self) -> str | None:
        return f"policy.dtype={self.dtype}" if self.dtype == "bfloat16" else None

    def training_preset(self) -> TrainingPreset:
        """LeRobot's: AdamW at optimizer_*, cosine decay with warm-up at scheduler_* (see flow_matching_preset)."""
        return flow_matching_preset(self)

    @property
    def action_delta_indices(self) -> list[int]:
        return list(range(self.chunk_size))

    def overrides_of(self, section: str) -> dict[str, int]:
        """The sizes ``policy.dimension_overrides.<section>`` sets (the null ones omitted)."""
        return {name: int(value) for name, value in (self.dimension_overrides.get(section) or {}).items()
                if value is not None}

    def gemma_dims(self, variant: str) -> GemmaDims:
        """The sizes of the stack named ``variant``, with its overrides."""
        return GemmaDims(**{**GEMMA_VARIANT_DIMS[variant], **self.overrides_of(variant)})

    @property
    def vlm_dims(self) -> GemmaDims:
        return self.gemma_dims(self.paligemma_variant)

    @property
    def expert_dims(self) -> GemmaDims:
        return self.gemma_dims(self.action_expert_variant)

    @property
    def vision_dims(self) -> SiglipDims:
        overrides = self.overrides_of("vision")
        return SiglipDims(**{**SIGLIP_DIMS, "projection_dim": self.vlm_dims.width, **overrides})

    @property
    def vocab_size(self) -> int:
        return int(self.overrides_of("text").get("vocab_size", PALIGEMMA_VOCAB_SIZE))

    def check_features(self, input_features: dict[str, dict], output_features: dict[str, dict]) -> None:
        check_padded_widths({"observation.state": ("max_state_dim", self.max_state_dim),
                             "action": ("max_action_dim", self.max_action_dim)}, {**input_features, **output_features})

    def check_fields(self) -> None:
        check_positive_ints({"chunk_size": self.chunk_size, "max_state_dim": self.max_state_dim,
                             "max_action_dim": self.max_action_dim, "num_inference_steps": self.num_inference_steps,
                             "tokenizer_max_length": self.tokenizer_max_length})
        if self.use_relative_actions:  # the processors refuse it too (a saved file that enables it)
            raise config_error("policy.use_relative_actions", True, "lerobot_mg does not train or run relative "
                               "actions (LeRobot's actions minus the current state)", "policy.use_relative_actions=false")
        if self.n_action_steps > self.chunk_size:
            raise config_error("policy.n_action_steps", self.n_action_steps,
                               f"cannot exceed policy.chunk_size={self.chunk_size}",
                               f"policy.n_action_steps={self.chunk_size}")
        for name, default in (("paligemma_variant", "gemma_2b"), ("action_expert_variant", "gemma_300m")):
            if getattr(self, name) not in GEMMA_VARIANTS:
                raise config_error(f"policy.{name}", getattr(self, name), f"is not one of {', '.join(GEMMA_VARIANTS)}",
                                   f"policy.{name}={default}")
        if self.dtype not in PI_DTYPES:
            raise config_error("policy.dtype", self.dtype, f"is not one of {', '.join(PI_DTYPES)}",
                               "policy.dtype=bfloat16")
        resolution = list(self.image_resolution)
        if len(resolution) != 2 or resolution[0] != resolution[1] or resolution[0] < 1:
            raise config_error("policy.image_resolution", resolution, "must be a square [size, size] (PaliGemma's "
                               "vision tower takes square images)", "policy.image_resolution=[224,224]")
        if self.empty_cameras < 0:
            raise config_error("policy.empty_cameras", self.empty_cameras, "must be >= 0", "policy.empty_cameras=0")
        if self.rtc_config is not None:
            raise config_error("policy.rtc_config", self.rtc_config, "real-time chunking is not supported",
                               "policy.rtc_config=null")
        if self.compile_model:
            raise config_error("policy.compile_model", True, "is LeRobot's switch; lerobot_mg compiles each joint "
                               "layer with accelerator.compile", "policy.compile_model=false accelerator.compile=true")
        self._check_dimension_overrides()

    def _check_dimension_overrides(self) -> None:
        for section, values in self.dimension_overrides.items():
            key = f"policy.dimension_overrides.{section}"
            if section not in OVERRIDE_SECTIONS:
                raise config_error(key, values, f"is not a section ({', '.join(OVERRIDE_SECTIONS)})", f"~{key}")
            for name, value in (values or {}).items():
                if name not in OVERRIDE_SECTIONS[section]:
                    raise config_error(f"{key}.{name}", value, f"is not a size of {section} "
                                       f"({', '.join(OVERRIDE_SECTIONS[section])})", f"~{key}.{name}")
                if value is not None and value < 1:
                    raise config_error(f"{key}.{name}", value, "must be >= 1", f"{key}.{name}=null")
        vlm, expert = self.vlm_dims, self.expert_dims
        for name in ("depth", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(vlm, name) != getattr(expert, name):
                raise config_error(
                    f"policy.dimension_overrides.{self.action_expert_variant}.{name}", getattr(expert, name),
                    f"the expert attends jointly with the vision-language model, so its {name} must equal the "
                    f"VLM's ({getattr(vlm, name)})",
                    f"policy.dimension_overrides.{self.action_expert_variant}.{name}={getattr(vlm, name)}")
        if vlm.num_heads % vlm.num_kv_heads:
            raise config_error(f"policy.dimension_overrides.{self.paligemma_variant}.num_kv_heads", vlm.num_kv_heads,
                               f"must divide num_heads={vlm.num_heads}",
                               f"policy.dimension_overrides.{self.paligemma_variant}.num_kv_heads=1")
        vision = self.vision_dims
        if vision.hidden_size % vision.num_attention_heads:
            raise config_error("policy.dimension_overrides.vision.num_attention_heads", vision.num_attention_heads,
                               f"must divide the vision width {vision.hidden_size}",
                               "policy.dimension_overrides.vision.num_attention_heads=1")
        if vision.projection_dim != vlm.width:
            raise config_error("policy.dimension_overrides.vision.projection_dim", vision.projection_dim,
                               f"must equal the language model's width {vlm.width} (image tokens join the prompt)",
                               f"policy.dimension_overrides.vision.projection_dim={vlm.width}")

