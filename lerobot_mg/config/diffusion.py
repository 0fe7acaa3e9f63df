"""Diffusion Policy's configuration: the policy's hyper-parameters and the Hydra schema of ``policy=diffusion``.

The fields, their types and their defaults are LeRobot 0.6.1's ``DiffusionConfig`` (Chi et al. 2023 settings), so a
``config.json`` written here loads in LeRobot and one written by LeRobot builds the same network here. The one
default that differs is ``pretrained_backbone_weights`` (null: nothing is downloaded unless asked for). The fields
that only lerobot_mg has are named in ``lerobot_mg_only_fields``; they live in ``train_config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd
from typing import ClassVar

from lerobot_mg.config.choices import (
    BetaSchedule,
    NoiseScheduler,
    NormalizationMode,
    OptimizerType,
    PredictionType,
    SchedulerType,
    VisionBackbone,
    check_choice,
)
from lerobot_mg.config.policy import PolicyConfig, check_positive_ints
from lerobot_mg.config.recipe import OptimizerConfig, SchedulerConfig, TrainingPreset
from lerobot_mg.errors import config_error


def _default_normalization_mapping() -> dict[str, NormalizationMode]:
    # As LeRobot: MIN_MAX maps states and actions to [-1, 1], the range clip_sample keeps samples in; a feature type
    # missing here (ENV) is passed through unchanged.
    return {
        "VISUAL": NormalizationMode.MEAN_STD, "STATE": NormalizationMode.MIN_MAX, "ACTION": NormalizationMode.MIN_MAX,
    }


def _default_down_dims() -> list[int]:
    return [512, 1024, 2048]


def _default_optimizer_betas() -> list[float]:
    return [0.95, 0.999]


def _pair_is_positive(values: list[int] | None) -> bool:
    return values is None or (len(values) == 2 and min(values) >= 1)


@dataclass
class DiffusionConfig(PolicyConfig):
    """Diffusion Policy (Chi et al. 2023, "Diffusion Policy: Visuomotor Policy Learning via Action Diffusion"),
    the 1-D temporal convolutional U-Net with FiLM conditioning, LeRobot 0.6.1's fields and defaults."""

    action_length_key: ClassVar[str] = "horizon"
    policy_class_path: ClassVar[str] = "lerobot_mg.policies.diffusion.modeling_diffusion:DiffusionPolicy"
    camera_only_fields: ClassVar[dict[str, str]] = {"vision_backbone": VisionBackbone.resnet18.value}

    type: str = "diffusion"
    # Frames of observation history, frames of actions predicted (starting n_obs_steps - 1 frames in the past),
    # and how many of them run before the next prediction.
    n_obs_steps: int = 2
    horizon: int = 64
    n_action_steps: int = 32
    normalization_mapping: dict[str, NormalizationMode] = field(default_factory=_default_normalization_mapping)
    # LeRobot's sampler skips the last frames of every episode (the original implementation does); kept so that
    # config.json round-trips. This trainer samples every frame.
    drop_n_last_frames: int = 7
    # Image encoder: resnet18 (LeRobot's: torchvision's ResNet18 without its last two children, then a spatial
    # softmax and a linear layer), or lerobot_mg_cnn (our small CNN of policy.vision_channels, lerobot_mg only).
    vision_backbone: VisionBackbone = VisionBackbone.resnet18
    # Images are resized to resize_shape [height, width] (null: kept), then cropped to crop_shape: at random in
    # training (crop_is_random), at the centre in evaluation; null: no crop. With resize_shape set, the crop is
    # crop_ratio of it instead (1.0: no crop), as LeRobot derives it.
    resize_shape: list[int] | None = None
    crop_ratio: float = 1.0
    crop_shape: list[int] | None = None
    crop_is_random: bool = True
    # torchvision's ImageNet ResNet18 weights for a fresh policy: a local file (resnet18-f37072fd.pth as torchvision
    # downloads it, or a .safetensors copy), or torchvision's weight name (ResNet18_Weights.IMAGENET1K_V1) where
    # torchvision is installed. null: random init. A policy built from a checkpoint never loads them.
    pretrained_backbone_weights: str | None = None
    # GroupNorm (num_features // 16 groups) instead of BatchNorm in the ResNet18; not with pretrained weights.
    use_group_norm: bool = False
    spatial_softmax_num_keypoints: int = 32
    use_separate_rgb_encoder_per_camera: bool = True
    # U-Net: one level per width (each level but the last halves the time axis), FiLM from the conditioning.
    down_dims: list[int] = field(default_factory=_default_down_dims)
    kernel_size: int = 5
    n_groups: int = 8
    diffusion_step_embed_dim: int = 128
    use_film_scale_modulation: bool = True
    # Recompute the U-Net's residual blocks in the backward pass (as accelerator.activation_checkpointing does).
    gradient_checkpointing: bool = False
    # Noise schedule (training) and sampler (inference): diffusers' DDPMScheduler / DDIMScheduler.
    noise_scheduler_type: NoiseScheduler = NoiseScheduler.DDPM
    num_train_timesteps: int = 100
    beta_schedule: BetaSchedule = BetaSchedule.squaredcos_cap_v2
    beta_start: float = 0.0001
    beta_end: float = 0.02
    prediction_type: PredictionType = PredictionType.epsilon
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    num_inference_steps: int | None = None  # None: num_train_timesteps
    # torch.compile the U-Net (in place: the state_dict keys stay the same).
    compile_model: bool = False
    compile_mode: str = "reduce-overhead"
    # Average the loss over the action frames inside the episode only (LeRobot's masked mean).
    do_mask_loss_for_padding: bool = False
    # LeRobot's training preset for Diffusion (training_preset: use_policy_training_preset). scheduler_name is
    # diffusers' schedule name (LeRobot's `diffuser` scheduler); only "cosine" is LeRobot's default and ours.
    optimizer_lr: float = 1e-4
    optimizer_betas: list[float] = field(default_factory=_default_optimizer_betas)
    optimizer_eps: float = 1e-8
    optimizer_weight_decay: float = 1e-6
    scheduler_name: str = "cosine"
    scheduler_warmup_steps: int = 500

    @property
    def observation_delta_indices(self) -> list[int]:
        return list(range(1 - self.n_obs_steps, 1))

    @property
    def action_delta_indices(self) -> list[int]:
        return list(range(1 - self.n_obs_steps, 1 - self.n_obs_steps + self.horizon))

    @property
    def inference_steps(self) -> int:
        return self.num_train_timesteps if self.num_inference_steps is None else self.num_inference_steps

    @property
    def image_crop_shape(self) -> list[int] | None:
        """The crop the image encoder applies (after the resize), as LeRobot derives it."""
        if self.resize_shape is None:
            return None if self.crop_shape is None else list(self.crop_shape)
        if self.crop_ratio < 1.0:
            return [int(self.resize_shape[0] * self.crop_ratio), int(self.resize_shape[1] * self.crop_ratio)]
        return None

    def training_preset(self) -> TrainingPreset:
        """LeRobot's: Adam (weight decay as an L2 penalty; clip 10, Adam's LeRobot default) at ``optimizer_lr``,
        ``optimizer_betas``, ``optimizer_eps`` and ``optimizer_weight_decay``, and diffusers' cosine schedule with
        ``scheduler_warmup_steps`` warm-up steps (fitted to a short run like any warm-up the config does not set)."""
        return TrainingPreset(
            OptimizerConfig(type=OptimizerType.adam, lr=self.optimizer_lr, betas=list(self.optimizer_betas),
                            eps=self.optimizer_eps, weight_decay=self.optimizer_weight_decay, grad_clip_norm=10.0,
                            param_groups=[]),
            SchedulerConfig(type=SchedulerType.diffuser_cosine, num_warmup_steps=self.scheduler_warmup_steps),
        )

    def check_fields(self) -> None:
        if self.scheduler_name != "cosine":
            raise config_error(
                "policy.scheduler_name", self.scheduler_name,
                "is not a schedule lerobot_mg implements (diffusers' cosine, LeRobot's default, is)",
                "policy.scheduler_name=cosine, or scheduler.type=<one of none, constant, cosine>",
            )
        check_positive_ints(
            {
                "n_obs_steps": self.n_obs_steps,
                "horizon": self.horizon,
                "spatial_softmax_num_keypoints": self.spatial_softmax_num_keypoints,
                "kernel_size": self.kernel_size,
                "n_groups": self.n_groups,
                "diffusion_step_embed_dim": self.diffusion_step_embed_dim,
                "num_train_timesteps": self.num_train_timesteps,
            }
        )
        if self.num_inference_steps is not None:
            check_positive_ints({"num_inference_steps": self.num_inference_steps})
        usable = self.horizon - self.n_obs_steps + 1
        if self.n_action_steps > usable:
            raise config_error(
                "policy.n_action_steps", self.n_action_steps,
                f"exceeds the {usable} frames a chunk holds from the current one on (horizon - n_obs_steps + 1 = "
                f"{self.horizon} - {self.n_obs_steps} + 1)",
                f"policy.n_action_steps={usable}, or a longer policy.horizon",
            )
        if not self.down_dims or any(width < 1 for width in self.down_dims):
            raise config_error(
                "policy.down_dims", list(self.down_dims), "needs at least one positive width",
                "policy.down_dims=[512,1024,2048]",
            )
        # LeRobot's rule (one factor of 2 more than the U-Net needs): a config accepted here loads there.
        downsampling = 2 ** len(self.down_dims)
        if self.horizon % downsampling:
            raise config_error(
                "policy.horizon", self.horizon,
                f"is not a multiple of {downsampling} (2 ** len(policy.down_dims), LeRobot's rule for "
                f"policy.down_dims={list(self.down_dims)})",
                f"policy.horizon={-(-self.horizon // downsampling) * downsampling}",
            )
        bad_groups = [width for width in self.down_dims if width % self.n_groups]
        if bad_groups:
            common = gcd(*self.down_dims)
            groups = next(k for k in range(min(self.n_groups, common), 0, -1) if common % k == 0)
            raise config_error(
                "policy.n_groups", self.n_groups,
                f"does not divide the U-Net widths {bad_groups} (policy.down_dims={list(self.down_dims)}); "
                "GroupNorm needs it to",
                f"policy.n_groups={groups}",
            )
        if self.down_dims[0] % 8:
            raise config_error(
                "policy.down_dims", list(self.down_dims),
                f"starts with {self.down_dims[0]}, which the U-Net's final block (GroupNorm with 8 groups, as in "
                "LeRobot) cannot split", f"policy.down_dims=[{-(-self.down_dims[0] // 8) * 8},...]",
            )
        if self.kernel_size % 2 == 0:
            raise config_error(
                "policy.kernel_size", self.kernel_size, "must be odd so that convolutions keep the horizon",
                f"policy.kernel_size={self.kernel_size + 1}",
            )
        self._check_image_fields()
        check_choice("policy.noise_scheduler_type", self.noise_scheduler_type, NoiseScheduler)
        check_choice("policy.beta_schedule", self.beta_schedule, BetaSchedule)
        check_choice("policy.prediction_type", self.prediction_type, PredictionType)
        if self.inference_steps > self.num_train_timesteps:
            raise config_error(
                "policy.num_inference_steps", self.num_inference_steps,
                f"exceeds policy.num_train_timesteps={self.num_train_timesteps}; the sampler walks a subset of the "
                "training timesteps",
                "policy.num_inference_steps=10 policy.noise_scheduler_type=DDIM",
            )
        if not 0.0 < self.beta_start < self.beta_end < 1.0:
            raise config_error(
                "policy.beta_start", self.beta_start,
                f"and policy.beta_end={self.beta_end} need 0 < beta_start < beta_end < 1",
                "policy.beta_start=0.0001 policy.beta_end=0.02",
            )
        if self.clip_sample_range <= 0:
            raise config_error(
                "policy.clip_sample_range", self.clip_sample_range, "must be > 0", "policy.clip_sample_range=1"
            )

    def _check_image_fields(self) -> None:
        check_choice("policy.vision_backbone", self.vision_backbone, VisionBackbone)
        if not _pair_is_positive(self.crop_shape):
            raise config_error(
                "policy.crop_shape", list(self.crop_shape or []),
                "must be [height, width] with positive sizes, or null for no crop", "policy.crop_shape=[84,84]",
            )
        if not _pair_is_positive(self.resize_shape):
            raise config_error(
                "policy.resize_shape", list(self.resize_shape or []),
                "must be [height, width] with positive sizes, or null to keep the image size",
                "policy.resize_shape=null",
            )
        if not 0.0 < self.crop_ratio <= 1.0:
            raise config_error("policy.crop_ratio", self.crop_ratio, "must be in (0, 1]", "policy.crop_ratio=1.0")
        if self.pretrained_backbone_weights is not None:
            if self.vision_backbone != VisionBackbone.resnet18:
                raise config_error(
                    "policy.pretrained_backbone_weights", self.pretrained_backbone_weights,
                    f"are ResNet18 weights, and policy.vision_backbone={self.vision_backbone} is trained from scratch",
                    "policy.pretrained_backbone_weights=null, or policy.vision_backbone=resnet18",
                )
            if self.use_group_norm:
                raise config_error(
                    "policy.use_group_norm", self.use_group_norm,
                    "would replace the batch norm layers that the pretrained backbone weights were trained with",
                    "policy.use_group_norm=false, or policy.pretrained_backbone_weights=null",
                )
