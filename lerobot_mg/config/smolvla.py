"""SmolVLA's configuration: the policy's hyper-parameters and the Hydra schema of ``policy=smolvla``.

The fields, their types and their defaults are LeRobot 0.6.1's ``SmolVLAConfig`` (Shukor et al. 2025, "SmolVLA: A
vision-language-action model for affordable and efficient robotics"), so a ``config.json`` written here loads in
LeRobot and one written by LeRobot builds the same network here. The vision-language model is named by
``vlm_model_name``: SmolVLM2-500M-Video-Instruct, whose architecture lerobot_mg knows without the Hub, or a local
folder holding a transformers ``SmolVLMConfig`` (its config.json). ``vlm_config_overrides`` (lerobot_mg only, in
train_config.json) changes the sizes of either, for small models without a folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lerobot_mg.config.choices import NormalizationMode
from lerobot_mg.config.policy import (
    PolicyConfig,
    check_padded_widths,
    check_positive_ints,
    empty_camera_key_names,
)
from lerobot_mg.config.recipe import TrainingPreset, flow_matching_preset
from lerobot_mg.errors import config_error

# The VLM SmolVLA is built on (LeRobot's default), whose architecture lerobot_mg holds in code.
SMOLVLM2_500M = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
# attention_mode values: every expert layer attends over both streams (self_attn), or every
# self_attn_every_n_layers-th does and the others attend to the VLM's keys and values only (cross_attn).
ATTENTION_MODES = ("cross_attn", "self_attn")
# The sections of a SmolVLMConfig that vlm_config_overrides may hold as mappings.
VLM_SUB_CONFIGS = ("text_config", "vision_config")


def _smolvla_normalization_mapping() -> dict[str, NormalizationMode]:
    # Images reach SmolVLA in [0, 1] (it maps them to [-1, 1] itself); states and actions are standardised.
    return {
        "VISUAL": NormalizationMode.IDENTITY,
        "STATE": NormalizationMode.MEAN_STD,
        "ACTION": NormalizationMode.MEAN_STD,
    }


def _default_resize() -> list[int]:
    return [512, 512]


def _default_optimizer_betas() -> list[float]:
    return [0.9, 0.95]


def is_local_vlm(name: str) -> bool:
    """``vlm_model_name`` names a folder on this machine (absolute or relative to the working directory)."""
    return Path(name).is_dir()


@dataclass
class SmolVLAConfig(PolicyConfig):
    """SmolVLA: SmolVLM's vision encoder and first ``num_vlm_layers`` language layers read the cameras, the task
    and the state (the prefix); a smaller action expert, layer by layer beside them, denoises the action chunk by
    flow matching (the suffix). LeRobot 0.6.1's fields."""

    action_length_key: ClassVar[str] = "chunk_size"
    policy_class_path: ClassVar[str] = "lerobot_mg.policies.smolvla.modeling_smolvla:SmolVLAPolicy"
    pads_missing_inputs: ClassVar[bool] = True
    lerobot_mg_only_fields: ClassVar[frozenset[str]] = PolicyConfig.lerobot_mg_only_fields | {"vlm_config_overrides"}

    type: str = "smolvla"
    # Actions predicted per chunk, and how many run before the next prediction.
    chunk_size: int = 50
    n_action_steps: int = 50
    normalization_mapping: dict[str, NormalizationMode] = field(default_factory=_smolvla_normalization_mapping)
    # States and actions are zero-padded to these widths (the projections' input sizes).
    max_state_dim: int = 32
    max_action_dim: int = 32
    # Every camera is resized without distortion and padded (left and top) to this size, as LeRobot stores it:
    # [width, height]. null: images are used at their own size (the VLM's image_size must match).
    resize_imgs_with_padding: list[int] | None = field(default_factory=_default_resize)
    # Cameras the model expects beyond the dataset's: fed as all-black images whose tokens are masked out.
    empty_cameras: int = 0
    # LeRobot's conversions for ALOHA robots (joint flips, gripper angle space): not supported here, and
    # use_delta_joint_actions_aloha is not implemented in LeRobot either (both must stay false).
    adapt_to_pi_aloha: bool = False
    use_delta_joint_actions_aloha: bool = False
    # The tokenizer's length limit for the task text (the processor reads it).
    tokenizer_max_length: int = 48
    # Euler steps of the flow-matching sampler.
    num_steps: int = 10
    # Inference runs the prefix once and keeps its keys and values for every denoising step (must stay true).
    use_cache: bool = True
    # Which parameters train: the vision encoder is frozen, and with train_expert_only the whole VLM (the
    # expert, the projections and, with train_state_proj, the state projection train).
    freeze_vision_encoder: bool = True
    train_expert_only: bool = True
    train_state_proj: bool = True
    # LeRobot's training recipe for SmolVLA (AdamW and a cosine schedule with warm-up), kept so that config.json
    # round-trips; whether a run uses it is the optimizer's business.
    optimizer_lr: float = 1e-4
    optimizer_betas: list[float] = field(default_factory=_default_optimizer_betas)
    optimizer_eps: float = 1e-8
    optimizer_weight_decay: float = 1e-10
    optimizer_grad_clip_norm: float = 10.0
    scheduler_warmup_steps: int = 1_000
    scheduler_decay_steps: int = 30_000
    scheduler_decay_lr: float = 2.5e-6
    # The VLM: HuggingFaceTB/SmolVLM2-500M-Video-Instruct (its architecture is known offline), or a local folder
    # holding a transformers SmolVLMConfig config.json. load_vlm_weights=true starts a new policy from the VLM's
    # published bfloat16 weights (the VLM and the expert are then bfloat16, as LeRobot builds them); false builds
    # it in float32 with random weights (a checkpoint's weights replace them when one is loaded).
    vlm_model_name: str = SMOLVLM2_500M
    load_vlm_weights: bool = False
    # LeRobot's option to frame each image with the tokenizer's image tokens (not supported here: must be false).
    add_image_special_tokens: bool = False
    attention_mode: str = "cross_attn"
    # Pad the prefix to this many tokens (-1: no padding).
    prefix_length: int = -1
    # The processor pads the task tokens to the longest in the batch ("longest") or to tokenizer_max_length
    # ("max_length").
    pad_language_to: str = "longest"
    # Expert depth: <= 0 (or num_vlm_layers) gives one expert layer per VLM layer, the only depth supported.
    num_expert_layers: int = -1
    # The first num_vlm_layers language layers of the VLM are kept (the rest are dropped).
    num_vlm_layers: int = 16
    # In cross_attn mode, layers 0, n, 2n, ... attend over both streams; the others cross-attend.
    self_attn_every_n_layers: int = 2
    # Expert width = int(VLM width * this); its MLP width follows LeRobot's rounding (a multiple of 256).
    expert_width_multiplier: float = 0.75
    # Periods of the sine-cosine embedding of the flow-matching time.
    min_period: float = 4e-3
    max_period: float = 4.0
    # LeRobot's real-time chunking settings (not supported here: must be null).
    rtc_config: dict[str, Any] | None = None
    compile_model: bool = False
    compile_mode: str = "max-autotune"

    # --- lerobot_mg only (train_config.json) ---
    # Fields of the VLM's SmolVLMConfig replaced on top of vlm_model_name's: top-level keys (scale_factor,
    # image_token_id) and the text_config / vision_config mappings, e.g.
    # {text_config: {hidden_size: 64, num_hidden_layers: 6}, vision_config: {hidden_size: 32}, scale_factor: 2}.
    vlm_config_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def observation_delta_indices(self) -> list[int]:
        """The current frame only, with a time axis of 1 (as LeRobot loads SmolVLA's observations)."""
        return [0]

    @property
    def empty_camera_keys(self) -> list[str]:
        return empty_camera_key_names(self.empty_cameras)

    @property
    def mixed_parameter_dtypes(self) -> str | None:
        return "policy.load_vlm_weights=true" if self.load_vlm_weights else None

    def training_preset(self) -> TrainingPreset:
        """LeRobot's: AdamW at optimizer_*, cosine decay with warm-up at scheduler_* (see flow_matching_preset)."""
        return flow_matching_preset(self)

    @property
    def action_delta_indices(self) -> list[int]:
        return list(range(self.chunk_size))

    def check_features(self, input_features: dict[str, dict], output_features: dict[str, dict]) -> None:
        check_padded_widths({"observation.state": ("max_state_dim", self.max_state_dim),
                             "action": ("max_action_dim", self.max_action_dim)}, {**input_features, **output_features})

    def check_fields(self) -> None:
        check_positive_ints({
            "chunk_size": self.chunk_size, "max_state_dim": self.max_state_dim,
            "max_action_dim": self.max_action_dim, "num_steps": self.num_steps, "num_vlm_layers": self.num_vlm_layers,
            "tokenizer_max_length": self.tokenizer_max_length,
        })
        if self.n_obs_steps != 1:
            raise config_error("policy.n_obs_steps", self.n_obs_steps, "must be 1: SmolVLA reads the current frame",
                               "policy.n_obs_steps=1")
        if self.n_action_steps > self.chunk_size:
            raise config_error(
                "policy.n_action_steps", self.n_action_steps,
                f"exceeds policy.chunk_size={self.chunk_size}: a chunk cannot feed more steps than it holds",
                f"policy.n_action_steps={self.chunk_size}",
            )
        if self.empty_cameras < 0:
            raise config_error("policy.empty_cameras", self.empty_cameras, "must be >= 0", "policy.empty_cameras=0")
        resize = self.resize_imgs_with_padding
        if resize is not None and (len(resize) != 2 or min(resize) < 1):
            raise config_error("policy.resize_imgs_with_padding", list(resize),
                               "must be [width, height] with positive sizes, or null to keep the images' size",
                               "policy.resize_imgs_with_padding=[512,512]")
        self._check_unsupported()
        self._check_layers()
        self._check_vlm()

    def _check_unsupported(self) -> None:
        refused = {
            "use_delta_joint_actions_aloha": (self.use_delta_joint_actions_aloha,
                                              "is not implemented (in LeRobot 0.6.1 neither)"),
            "adapt_to_pi_aloha": (self.adapt_to_pi_aloha,
                                  "(LeRobot's conversion of ALOHA joints to the pi runtime's space) is not supported"),
            "add_image_special_tokens": (self.add_image_special_tokens,
                                         "needs the tokenizer's image token ids, which lerobot_mg's SmolVLA does not "
                                         "read"),
            "compile_model": (self.compile_model, "is not how lerobot_mg compiles: use accelerator.compile=true"),
        }
        for name, (value, problem) in refused.items():
            if value:
                raise config_error(f"policy.{name}", value, problem, f"policy.{name}=false")
        if not self.use_cache:
            raise config_error("policy.use_cache", self.use_cache,
                               "would run each denoising step without the prefix's keys and values, which the "
                               "expert attends to (LeRobot 0.6.1 fails on it in cross_attn mode)",
                               "policy.use_cache=true")
        if self.rtc_config is not None:
            raise config_error("policy.rtc_config", self.rtc_config, "real-time chunking is not supported",
                               "policy.rtc_config=null")
        if self.pad_language_to not in ("longest", "max_length"):
            raise config_error("policy.pad_language_to", self.pad_language_to, "must be longest or max_length",
                               "policy.pad_language_to=longest")

    def _check_layers(self) -> None:
        if self.attention_mode not in ATTENTION_MODES:
            raise config_error("policy.attention_mode", self.attention_mode,
                               f"must be one of {', '.join(ATTENTION_MODES)}", "policy.attention_mode=cross_attn")
        if self.num_expert_layers > 0 and self.num_expert_layers != self.num_vlm_layers:
            raise config_error(
                "policy.num_expert_layers", self.num_expert_layers,
                f"gives fewer expert layers than policy.num_vlm_layers={self.num_vlm_layers}, which is not "
                "supported (LeRobot 0.6.1's own inference fails on it)",
                "policy.num_expert_layers=-1 (one expert layer per VLM layer)",
            )
        if not 0.0 < self.expert_width_multiplier <= 4.0:
            raise config_error("policy.expert_width_multiplier", self.expert_width_multiplier, "must be in (0, 4]",
                               "policy.expert_width_multiplier=0.75")
        if not 0.0 < self.min_period < self.max_period:
            raise config_error("policy.min_period", self.min_period,
                               f"and policy.max_period={self.max_period} need 0 < min_period < max_period",
                               "policy.min_period=0.004 policy.max_period=4.0")

    def _check_vlm(self) -> None:
        name = self.vlm_model_name
        if name != SMOLVLM2_500M and not is_local_vlm(name):
            raise config_error(
                "policy.vlm_model_name", name,
                f"is neither {SMOLVLM2_500M} (whose architecture lerobot_mg knows) nor a folder on this machine",
                f"policy.vlm_model_name={SMOLVLM2_500M}, or a folder holding a SmolVLMConfig config.json",
            )
        if is_local_vlm(name) and not (Path(name) / "config.json").is_file():
            raise config_error("policy.vlm_model_name", name, "is a folder without the VLM's config.json",
                               "a folder holding a transformers SmolVLMConfig config.json")
        for key, value in self.vlm_config_overrides.items():
            if key in VLM_SUB_CONFIGS and not isinstance(value, dict):
                raise config_error(f"policy.vlm_config_overrides.{key}", value,
                                   "must be a mapping of that section's fields",
                                   f"policy.vlm_config_overrides.{key}={{hidden_size: 64}}")
