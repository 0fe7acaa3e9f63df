"""Diffusion Policy configuration: the policy's hyper-parameters and its Hydra schema in the `policy` group.

Field names and defaults follow LeRobot's `DiffusionConfig` (Chi et al. 2023 settings). The vision encoder is
ours (lerobot_mg.policies.vision, trained from scratch) where LeRobot uses a torchvision ResNet-18. Only plain
types appear here: the dataclass is registered in Hydra's ConfigStore and must survive an OmegaConf round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lerobot_mg.errors import ConfigError
from lerobot_mg.policies.config_checks import (
    check_inputs_and_normalization,
    check_positive_ints,
    check_vision_channels,
)

NOISE_SCHEDULERS = ("DDPM", "DDIM")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "sample")


def _default_normalization_mapping() -> dict[str, str]:
    # As LeRobot: MIN_MAX maps states and actions to [-1, 1], the range clip_sample keeps samples in.
    return {"VISUAL": "MEAN_STD", "STATE": "MIN_MAX", "ENV": "MIN_MAX", "ACTION": "MIN_MAX"}


def _default_down_dims() -> list[int]:
    return [512, 1024, 2048]


def _default_crop_shape() -> list[int] | None:
    return [84, 84]


def _default_vision_channels() -> list[int]:
    return [32, 64, 128, 256]


@dataclass
class DiffusionConfig:
    """Diffusion Policy (Chi et al. 2023, "Diffusion Policy: Visuomotor Policy Learning via Action Diffusion"),
    the 1-D temporal convolutional U-Net with FiLM conditioning, LeRobot-compatible field names."""

    action_length_key: ClassVar[str] = "horizon"  # the field that sets len(action_delta_indices)
    type: str = "diffusion"
    # A pretrained_model/ directory to start from (config + weights + processors): fine-tuning, with or without
    # peft.*. Its config.json replaces this group's values; policy.* overrides on the command line apply on top.
    path: str | None = None
    # Dataset keys fed to the policy; None means every `observation.*` key of the dataset.
    observation_keys: list[str] | None = None
    # Frames of observation history, frames of actions predicted (starting n_obs_steps - 1 frames in the past),
    # and how many of them run before the next prediction.
    n_obs_steps: int = 2
    horizon: int = 16
    n_action_steps: int = 8
    # Image encoder: our backbone's stage widths, then a spatial softmax with this many keypoints per camera.
    vision_channels: list[int] = field(default_factory=_default_vision_channels)
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
    noise_scheduler_type: str = "DDPM"
    num_train_timesteps: int = 100
    beta_schedule: str = "squaredcos_cap_v2"
    beta_start: float = 0.0001
    beta_end: float = 0.02
    prediction_type: str = "epsilon"
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    num_inference_steps: int | None = None  # None: num_train_timesteps
    # Leave padded action frames (past an episode's end) out of the loss.
    do_mask_loss_for_padding: bool = False
    # Normalisation mode per feature type: MEAN_STD, MIN_MAX (to [-1, 1]) or IDENTITY.
    normalization_mapping: dict[str, str] = field(default_factory=_default_normalization_mapping)

    @property
    def observation_delta_indices(self) -> list[int]:
        return list(range(1 - self.n_obs_steps, 1))

    @property
    def action_delta_indices(self) -> list[int]:
        return list(range(1 - self.n_obs_steps, 1 - self.n_obs_steps + self.horizon))

    @property
    def inference_steps(self) -> int:
        return self.num_train_timesteps if self.num_inference_steps is None else self.num_inference_steps

    def validate(self) -> None:
        """Raise a ConfigError naming `policy.<field>`, the bad value and the fix."""
        if self.type != "diffusion":
            raise ConfigError(f"policy.type={self.type!r} does not match DiffusionConfig; use policy=diffusion.")
        check_positive_ints(
            {
                "n_obs_steps": self.n_obs_steps,
                "horizon": self.horizon,
                "n_action_steps": self.n_action_steps,
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
            raise ConfigError(
                f"policy.n_action_steps={self.n_action_steps} exceeds the {usable} frames a chunk holds from the "
                f"current one on (horizon - n_obs_steps + 1 = {self.horizon} - {self.n_obs_steps} + 1). Set "
                f"policy.n_action_steps<={usable} or a longer policy.horizon."
            )
        if not self.down_dims or any(width < 1 for width in self.down_dims):
            raise ConfigError(
                f"policy.down_dims={list(self.down_dims)} needs at least one positive width; pass e.g. "
                "policy.down_dims=[512,1024,2048]."
            )
        downsampling = 2 ** (len(self.down_dims) - 1)
        if self.horizon % downsampling:
            raise ConfigError(
                f"policy.horizon={self.horizon} is not a multiple of {downsampling}, the U-Net's downsampling "
                f"factor with {len(self.down_dims)} levels (policy.down_dims={list(self.down_dims)}). Set "
                f"policy.horizon={-(-self.horizon // downsampling) * downsampling}."
            )
        bad_groups = [width for width in self.down_dims if width % self.n_groups]
        if bad_groups:
            raise ConfigError(
                f"policy.n_groups={self.n_groups} does not divide the U-Net widths {bad_groups} "
                f"(policy.down_dims={list(self.down_dims)}); GroupNorm needs it to. Pass e.g. policy.n_groups=8."
            )
        if self.kernel_size % 2 == 0:
            raise ConfigError(
                f"policy.kernel_size={self.kernel_size} must be odd so that convolutions keep the horizon; "
                f"pass e.g. policy.kernel_size={self.kernel_size + 1}."
            )
        if self.crop_shape is not None and (len(self.crop_shape) != 2 or min(self.crop_shape) < 1):
            raise ConfigError(
                f"policy.crop_shape={list(self.crop_shape)} must be [height, width] with positive sizes, or null "
                "for no crop; pass e.g. policy.crop_shape=[84,84]."
            )
        choices = {
            "noise_scheduler_type": (self.noise_scheduler_type, NOISE_SCHEDULERS),
            "beta_schedule": (self.beta_schedule, BETA_SCHEDULES),
            "prediction_type": (self.prediction_type, PREDICTION_TYPES),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConfigError(
                    f"policy.{name}={value!r} is not one of {list(allowed)}; pass e.g. policy.{name}={allowed[0]}."
                )
        if self.inference_steps > self.num_train_timesteps:
            raise ConfigError(
                f"policy.num_inference_steps={self.num_inference_steps} exceeds policy.num_train_timesteps="
                f"{self.num_train_timesteps}; the sampler walks a subset of the training timesteps. Pass e.g. "
                "policy.num_inference_steps=10 (with policy.noise_scheduler_type=DDIM)."
            )
        if not 0.0 < self.beta_start < self.beta_end < 1.0:
            raise ConfigError(
                f"policy.beta_start={self.beta_start} and policy.beta_end={self.beta_end} need "
                "0 < beta_start < beta_end < 1; pass e.g. policy.beta_start=0.0001 policy.beta_end=0.02."
            )
        if self.clip_sample_range <= 0:
            raise ConfigError(
                f"policy.clip_sample_range={self.clip_sample_range} must be > 0; pass e.g. policy.clip_sample_range=1."
            )
        check_vision_channels(self.vision_channels, "[32,64,128,256]")
        check_inputs_and_normalization(self)
