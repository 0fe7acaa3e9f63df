"""Diffusion Policy's configuration: the policy's hyper-parameters and the Hydra schema of ``policy=diffusion``.

Field names and defaults follow LeRobot's ``DiffusionConfig`` (Chi et al. 2023 settings). The vision encoder is
ours (lerobot_mg.policies.vision, trained from scratch) where LeRobot uses a torchvision ResNet-18.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd
from typing import ClassVar

from lerobot_mg.config.choices import (
    BetaSchedule,
    NoiseScheduler,
    NormalizationMode,
    PredictionType,
    check_choice,
)
from lerobot_mg.config.policy import PolicyConfig, check_positive_ints
from lerobot_mg.errors import config_error


def _default_normalization_mapping() -> dict[str, NormalizationMode]:
    # As LeRobot: MIN_MAX maps states and actions to [-1, 1], the range clip_sample keeps samples in.
    return {
        "VISUAL": NormalizationMode.MEAN_STD, "STATE": NormalizationMode.MIN_MAX,
        "ENV": NormalizationMode.MIN_MAX, "ACTION": NormalizationMode.MIN_MAX,
    }


def _default_down_dims() -> list[int]:
    return [512, 1024, 2048]


def _default_crop_shape() -> list[int] | None:
    return [84, 84]


@dataclass
class DiffusionConfig(PolicyConfig):
    """Diffusion Policy (Chi et al. 2023, "Diffusion Policy: Visuomotor Policy Learning via Action Diffusion"),
    the 1-D temporal convolutional U-Net with FiLM conditioning, LeRobot-compatible field names."""

    action_length_key: ClassVar[str] = "horizon"

    type: str = "diffusion"
    # Frames of observation history, frames of actions predicted (starting n_obs_steps - 1 frames in the past),
    # and how many of them run before the next prediction.
    n_obs_steps: int = 2
    horizon: int = 16
    n_action_steps: int = 8
    # Image encoder: after the backbone (vision_channels), a spatial softmax with this many keypoints per camera.
    spatial_softmax_num_keypoints: int = 32
    # Images are cropped to this (height, width): at random in training, at the centre at inference. null: no crop.
    crop_shape: list[int] | None = field(default_factory=_default_crop_shape)
    crop_is_random: bool = True
    use_separate_rgb_encoder_per_camera: bool = False
    # U-Net: one level per width (each level but the last halves the time axis), FiLM from the conditioning.
    down_dims: list[int] = field(default_factory=_default_down_dims)
    kernel_size: int = 5
    n_groups: int = 8
    diffusion_step_embed_dim: int = 128
    use_film_scale_modulation: bool = True
    # Noise schedule (training) and sampler (inference).
    noise_scheduler_type: NoiseScheduler = NoiseScheduler.DDPM
    num_train_timesteps: int = 100
    beta_schedule: BetaSchedule = BetaSchedule.squaredcos_cap_v2
    beta_start: float = 0.0001
    beta_end: float = 0.02
    prediction_type: PredictionType = PredictionType.epsilon
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    num_inference_steps: int | None = None  # None: num_train_timesteps
    # Leave padded action frames (past an episode's end) out of the loss.
    do_mask_loss_for_padding: bool = False
    normalization_mapping: dict[str, NormalizationMode] = field(default_factory=_default_normalization_mapping)

    @property
    def observation_delta_indices(self) -> list[int]:
        return list(range(1 - self.n_obs_steps, 1))

    @property
    def action_delta_indices(self) -> list[int]:
        return list(range(1 - self.n_obs_steps, 1 - self.n_obs_steps + self.horizon))

    @property
    def inference_steps(self) -> int:
        return self.num_train_timesteps if self.num_inference_steps is None else self.num_inference_steps

    def check_fields(self) -> None:
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
        downsampling = 2 ** (len(self.down_dims) - 1)
        if self.horizon % downsampling:
            raise config_error(
                "policy.horizon", self.horizon,
                f"is not a multiple of {downsampling}, the U-Net's downsampling factor with {len(self.down_dims)} "
                f"levels (policy.down_dims={list(self.down_dims)})",
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
        if self.kernel_size % 2 == 0:
            raise config_error(
                "policy.kernel_size", self.kernel_size, "must be odd so that convolutions keep the horizon",
                f"policy.kernel_size={self.kernel_size + 1}",
            )
        if self.crop_shape is not None and (len(self.crop_shape) != 2 or min(self.crop_shape) < 1):
            raise config_error(
                "policy.crop_shape", list(self.crop_shape),
                "must be [height, width] with positive sizes, or null for no crop", "policy.crop_shape=[84,84]",
            )
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
