"""Checks every policy config shares: positive sizes, normalisation modes, observation keys, vision widths.

Plain Python (no torch): the config dataclasses import it and are themselves Hydra schemas.
"""

from __future__ import annotations

from typing import Any

from lerobot_mg.errors import ConfigError

FEATURE_TYPES = ("VISUAL", "STATE", "ENV", "ACTION")
NORMALIZATION_MODES = ("MEAN_STD", "MIN_MAX", "IDENTITY")


def check_positive_ints(values: dict[str, int]) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"policy.{name}={value} must be >= 1; pass e.g. policy.{name}=1.")


def check_vision_channels(vision_channels: list[int], example: str) -> None:
    if not vision_channels or any(width < 1 for width in vision_channels):
        raise ConfigError(
            f"policy.vision_channels={list(vision_channels)} needs at least one positive stage width; "
            f"pass e.g. policy.vision_channels={example}."
        )


def check_inputs_and_normalization(config: Any) -> None:
    """`normalization_mapping` and `observation_keys`, the fields every policy config has."""
    for feature_type, mode in config.normalization_mapping.items():
        if feature_type not in FEATURE_TYPES:
            raise ConfigError(
                f"policy.normalization_mapping has unknown feature type {feature_type!r}; "
                f"use one of {list(FEATURE_TYPES)}."
            )
        if mode not in NORMALIZATION_MODES:
            raise ConfigError(
                f"policy.normalization_mapping.{feature_type}={mode!r} is not one of "
                f"{list(NORMALIZATION_MODES)}; pass e.g. policy.normalization_mapping.{feature_type}=MEAN_STD."
            )
    if config.observation_keys is not None:
        bad_keys = [key for key in config.observation_keys if not key.startswith("observation.")]
        if not config.observation_keys or bad_keys:
            raise ConfigError(
                f"policy.observation_keys={list(config.observation_keys)} must be a non-empty list of "
                "`observation.*` dataset keys; pass e.g. policy.observation_keys=[observation.state] "
                "or policy.observation_keys=null for all of them."
            )
