"""Normalisation steps and the policy's pre/post-processor pair.

Modes (per feature type, from `policy.normalization_mapping`):
  MEAN_STD: (x - mean) / (std + eps)
  MIN_MAX:  (x - min) / (max - min + eps) * 2 - 1, i.e. to [-1, 1]
  IDENTITY: untouched
The preprocessor normalises observation inputs and the `action` targets; the postprocessor maps the
policy's `action` output back to dataset units. Keys absent from a batch are skipped (an inference batch
carries no `action`), so the same preprocessor serves training and rollouts.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from torch import Tensor

from lerobot_mg.errors import config_error
from lerobot_mg.policies.base import FeatureSpec
from lerobot_mg.processors.pipeline import PolicyProcessorPipeline, ProcessorStep, register_step

# Keeps a constant feature (std == 0 or max == min) finite instead of dividing by zero.
DEFAULT_EPS = 1e-8

STATS_PER_MODE: dict[str, tuple[str, ...]] = {
    "MEAN_STD": ("mean", "std"),
    "MIN_MAX": ("min", "max"),
    "IDENTITY": (),
}

NormStepT = TypeVar("NormStepT", bound="_NormalizationStep")
StatValue = Tensor | np.ndarray | list[Any] | float


class _NormalizationStep(ProcessorStep):
    """Holds per-key statistics for the features it handles; subclasses pick the direction."""

    def __init__(
        self,
        features: dict[str, FeatureSpec],
        norm_map: dict[str, str],
        stats: dict[str, dict[str, StatValue]],
        eps: float = DEFAULT_EPS,
    ) -> None:
        self.features = {
            key: {"type": spec["type"], "shape": list(spec["shape"])} for key, spec in features.items()
        }
        self.norm_map = dict(norm_map)
        self.eps = eps
        # Missing feature types are left unnormalised, like an explicit IDENTITY.
        self.modes = {key: self.norm_map.get(spec["type"], "IDENTITY") for key, spec in self.features.items()}
        self.stats: dict[str, dict[str, Tensor]] = {}
        for key, mode in self.modes.items():
            if mode not in STATS_PER_MODE:
                feature_type = self.features[key]["type"]
                raise config_error(f"policy.normalization_mapping.{feature_type}", mode,
                                   f"is not a normalisation mode (for {key!r})",
                                   f"policy.normalization_mapping.{feature_type}=<one of {list(STATS_PER_MODE)}>")
            if mode == "IDENTITY":
                continue
            self.stats[key] = {}
            for stat_name in STATS_PER_MODE[mode]:
                value = stats.get(key, {}).get(stat_name)
                if value is None:
                    feature_type = self.features[key]["type"]
                    raise config_error(
                        f"policy.normalization_mapping.{feature_type}", mode,
                        f"needs the {stat_name!r} statistic of {key!r}, which the dataset's stats lack",
                        f"policy.normalization_mapping.{feature_type}=IDENTITY, or a dataset whose meta/stats.json "
                        "includes it",
                    )
                tensor = torch.as_tensor(value, dtype=torch.float32).clone()
                shape = tuple(self.features[key]["shape"])
                try:
                    broadcast = torch.broadcast_shapes(tensor.shape, shape)
                except RuntimeError:
                    broadcast = None
                if broadcast != shape:
                    raise config_error(
                        f"stats[{key!r}][{stat_name!r}].shape", tuple(tensor.shape),
                        f"does not broadcast to the feature shape {shape}; the stats belong to a different dataset",
                        "the stats of this dataset (its meta/stats.json), or the dataset they belong to "
                        "(dataset.root)",
                    )
                self.stats[key][stat_name] = tensor

    def _stat(self, key: str, stat_name: str, like: Tensor) -> Tensor:
        return self.stats[key][stat_name].to(device=like.device, dtype=like.dtype)

    @abc.abstractmethod
    def _apply(self, key: str, mode: str, x: Tensor) -> Tensor:
        """Transform one feature tensor in `mode` (never IDENTITY)."""

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        out = dict(batch)
        for key, mode in self.modes.items():
            if mode == "IDENTITY" or key not in batch:
                continue
            x = batch[key]
            # At least float32: bf16 statistics would shift a normalised action by up to ~0.4% of its scale.
            if not torch.is_floating_point(x) or torch.finfo(x.dtype).bits < 32:
                x = x.to(torch.float32)
            out[key] = self._apply(key, mode, x)
        return out

    def get_config(self) -> dict[str, Any]:
        return {"features": self.features, "norm_map": self.norm_map, "eps": self.eps}

    def state_dict(self) -> dict[str, Tensor]:
        return {
            f"{key}.{stat_name}": tensor
            for key, per_key in self.stats.items()
            for stat_name, tensor in per_key.items()
        }

    def to(self: NormStepT, device: torch.device | str) -> NormStepT:
        for per_key in self.stats.values():
            for stat_name in per_key:
                per_key[stat_name] = per_key[stat_name].to(device)
        return self

    @classmethod
    def from_config(cls: type[NormStepT], config: dict[str, Any], state: dict[str, Tensor]) -> NormStepT:
        stats: dict[str, dict[str, StatValue]] = {}
        for flat_key, tensor in state.items():
            # Feature keys contain dots themselves; the statistic name is the last component.
            key, stat_name = flat_key.rsplit(".", 1)
            stats.setdefault(key, {})[stat_name] = tensor
        return cls(config["features"], config["norm_map"], stats, eps=float(config["eps"]))


@register_step
class NormalizerStep(_NormalizationStep):
    name: ClassVar[str] = "normalizer"

    def _apply(self, key: str, mode: str, x: Tensor) -> Tensor:
        if mode == "MEAN_STD":
            return (x - self._stat(key, "mean", x)) / (self._stat(key, "std", x) + self.eps)
        low, high = self._stat(key, "min", x), self._stat(key, "max", x)
        return (x - low) / (high - low + self.eps) * 2 - 1


@register_step
class UnnormalizerStep(_NormalizationStep):
    name: ClassVar[str] = "unnormalizer"

    def _apply(self, key: str, mode: str, x: Tensor) -> Tensor:
        if mode == "MEAN_STD":
            return x * (self._stat(key, "std", x) + self.eps) + self._stat(key, "mean", x)
        low, high = self._stat(key, "min", x), self._stat(key, "max", x)
        return (x + 1) / 2 * (high - low + self.eps) + low


def make_processors(
    policy_cfg: Any,
    input_features: dict[str, FeatureSpec],
    output_features: dict[str, FeatureSpec],
    stats: dict[str, dict[str, StatValue]],
) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """(preprocessor, postprocessor) for a policy config carrying `normalization_mapping`.

    Preprocessor: normalise inputs and `action`. Postprocessor: unnormalise `action`.
    """
    norm_map = {str(key): str(value) for key, value in dict(policy_cfg.normalization_mapping).items()}
    preprocessor = PolicyProcessorPipeline(
        "policy_preprocessor", [NormalizerStep({**input_features, **output_features}, norm_map, stats)]
    )
    postprocessor = PolicyProcessorPipeline(
        "policy_postprocessor", [UnnormalizerStep(output_features, norm_map, stats)]
    )
    return preprocessor, postprocessor


def load_processors(directory: Path) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """(preprocessor, postprocessor) saved in a ``pretrained_model`` directory: the statistics a policy was trained
    with, for training on from it (resume, fine-tuning) and for running it (evaluation)."""
    return (PolicyProcessorPipeline.from_pretrained(directory, "policy_preprocessor"),
            PolicyProcessorPipeline.from_pretrained(directory, "policy_postprocessor"))


def processors_for(policy_cfg: Any, policy: Any, stats: dict[str, dict[str, StatValue]],
                   saved_dir: Path | None) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """A run's (preprocessor, postprocessor): those saved in ``saved_dir`` (the checkpoint it resumes, or the base it
    fine-tunes: the statistics those weights were trained with), else new ones on this dataset's ``stats``."""
    if saved_dir is None:
        return make_processors(policy_cfg, policy.input_features, policy.output_features, stats)
    return load_processors(saved_dir)
