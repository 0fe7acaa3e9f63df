"""ACT configuration: the policy's hyper-parameters and the Hydra schema of the `policy` group.

Only plain types appear here (int, float, bool, str, lists and dicts of them, Optional) because the
same dataclass is registered in Hydra's ConfigStore and must survive an OmegaConf round trip.
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

FEEDFORWARD_ACTIVATIONS = ("relu", "gelu")


def _default_normalization_mapping() -> dict[str, str]:
    return {"VISUAL": "MEAN_STD", "STATE": "MEAN_STD", "ENV": "MEAN_STD", "ACTION": "MEAN_STD"}


def _default_vision_channels() -> list[int]:
    # Stage widths of our own small ResNet-style backbone (one BasicBlock per stage, total stride 16).
    # Trained from scratch: no downloaded weights.
    return [32, 64, 128, 256]


@dataclass
class ACTConfig:
    """Action Chunking Transformer (Zhao et al. 2023), LeRobot-compatible field names."""

    action_length_key: ClassVar[str] = "chunk_size"  # the field that sets len(action_delta_indices)
    type: str = "act"
    # A pretrained_model/ directory to start from (config + weights + processors): fine-tuning, with or without
    # peft.*. Its config.json replaces this group's values; policy.* overrides on the command line apply on top.
    path: str | None = None
    # Dataset keys fed to the policy; None means every `observation.*` key of the dataset.
    observation_keys: list[str] | None = None
    chunk_size: int = 100
    n_action_steps: int = 100
    dim_model: int = 512
    n_heads: int = 8
    dim_feedforward: int = 3200
    feedforward_activation: str = "relu"
    n_encoder_layers: int = 4
    # The original ACT code builds 7 decoder layers but only runs the first one; 1 matches its behaviour.
    n_decoder_layers: int = 1
    pre_norm: bool = False
    use_vae: bool = True
    latent_dim: int = 32
    n_vae_encoder_layers: int = 4
    dropout: float = 0.1
    kl_weight: float = 10.0
    vision_channels: list[int] = field(default_factory=_default_vision_channels)
    # Normalisation mode per feature type: MEAN_STD, MIN_MAX (to [-1, 1]) or IDENTITY.
    normalization_mapping: dict[str, str] = field(default_factory=_default_normalization_mapping)

    @property
    def observation_delta_indices(self) -> None:
        """ACT reads the current frame only."""
        return None

    @property
    def action_delta_indices(self) -> list[int]:
        """Frame offsets of the action chunk the dataset must load for each sample."""
        return list(range(self.chunk_size))

    def validate(self) -> None:
        """Raise a ConfigError naming `policy.<field>`, the bad value and the fix."""
        if self.type != "act":
            raise ConfigError(f"policy.type={self.type!r} does not match ACTConfig; use policy=act.")
        positive_ints = {
            "chunk_size": self.chunk_size,
            "n_action_steps": self.n_action_steps,
            "dim_model": self.dim_model,
            "n_heads": self.n_heads,
            "dim_feedforward": self.dim_feedforward,
            "n_encoder_layers": self.n_encoder_layers,
            "n_decoder_layers": self.n_decoder_layers,
            "latent_dim": self.latent_dim,
        }
        if self.use_vae:
            positive_ints["n_vae_encoder_layers"] = self.n_vae_encoder_layers
        check_positive_ints(positive_ints)
        if self.n_action_steps > self.chunk_size:
            raise ConfigError(
                f"policy.n_action_steps={self.n_action_steps} exceeds policy.chunk_size={self.chunk_size}: "
                f"a chunk cannot feed more steps than it holds. Set policy.n_action_steps<={self.chunk_size}."
            )
        if self.dim_model % self.n_heads != 0:
            raise ConfigError(
                f"policy.dim_model={self.dim_model} is not divisible by policy.n_heads={self.n_heads}; "
                "choose values such that dim_model % n_heads == 0 (e.g. policy.n_heads=8 with dim_model=512)."
            )
        if self.feedforward_activation not in FEEDFORWARD_ACTIVATIONS:
            raise ConfigError(
                f"policy.feedforward_activation={self.feedforward_activation!r} is not one of "
                f"{list(FEEDFORWARD_ACTIVATIONS)}; pass e.g. policy.feedforward_activation=relu."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                f"policy.dropout={self.dropout} must be in [0, 1); pass e.g. policy.dropout=0.1."
            )
        if self.kl_weight < 0:
            raise ConfigError(
                f"policy.kl_weight={self.kl_weight} must be >= 0; pass e.g. policy.kl_weight=10."
            )
        check_vision_channels(self.vision_channels, "[32,64,128,256]")
        check_inputs_and_normalization(self)
