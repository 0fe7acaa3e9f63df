"""Normalisation steps and the policy's pre/post-processor pair, as LeRobot 0.6.1 computes and saves them.

The mode of a feature is ``norm_map[feature type]`` (``policy.normalization_mapping``); a type the map lacks is
IDENTITY (ACT's default map has no ENV entry, so ``observation.environment_state`` passes unchanged):
  MEAN_STD: (x - mean) / (std + eps), inverse x * std + mean
  MIN_MAX:  2 (x - min) / (max - min) - 1, to [-1, 1] (a zero range counts as eps), inverse (x + 1) / 2 * range + min
  QUANTILES: 2 (x - q01) / (q99 - q01) - 1, inverse (x + 1) (q99 - q01) / 2 + q01: MIN_MAX with the 1st and 99th
            percentiles in place of min and max, the bulk of the data in [-1, 1] and outliers beyond (pi0.5's
            default); QUANTILE10 the same with q10 and q90
  IDENTITY: untouched
The preprocessor normalises observation inputs and the ``action`` targets; the postprocessor maps the policy's
``action`` output back to dataset units. Keys absent from a batch are skipped (an inference batch carries no
``action``), so the same preprocessor serves training and rollouts. A step keeps every statistic of every dataset
key (LeRobot's state file holds them all); 1-D statistics of a camera feature are reshaped to (C, 1, 1).

Camera statistics: LeRobot's training replaces each camera's mean/std by ImageNet's before building the processors
(``dataset.use_imagenet_stats``, true by default there and here), whatever the backbone; uint8 frames are scaled to
[0, 1] before the preprocessor (lerobot_mg.step.to_device).
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from torch import Tensor

from lerobot_mg.config.choices import FeatureType, NormalizationMode
from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.policies.base import FeatureSpec
from lerobot_mg.processors.pipeline import PolicyProcessorPipeline, ProcessorStep, register_step
from lerobot_mg.processors.steps import DeviceStep, RenameObservationsStep, ToBatchStep
from lerobot_mg.processors.vla import VLA_TYPES, vla_pipelines

# Keeps a constant feature (std == 0) finite instead of dividing by zero; LeRobot's default.
DEFAULT_EPS = 1e-8

STATS_PER_MODE: dict[NormalizationMode, tuple[str, ...]] = {
    NormalizationMode.MEAN_STD: ("mean", "std"),
    NormalizationMode.MIN_MAX: ("min", "max"),
    NormalizationMode.QUANTILES: ("q01", "q99"),
    NormalizationMode.QUANTILE10: ("q10", "q90"),
    NormalizationMode.IDENTITY: (),
}
# What LeRobot's training puts in place of a camera's mean and std (lerobot.utils.constants.IMAGENET_STATS).
IMAGENET_STATS = {"mean": [[[0.485]], [[0.456]], [[0.406]]], "std": [[[0.229]], [[0.224]], [[0.225]]]}

NormStepT = TypeVar("NormStepT", bound="_NormalizationStep")
StatValue = Tensor | np.ndarray | list[Any] | float


def camera_keys(dataset_features: dict[str, dict[str, Any]]) -> list[str]:
    """The dataset's cameras: its features stored as images or video."""
    return [key for key, spec in dataset_features.items() if spec.get("dtype") in ("image", "video")]


def with_imagenet_stats(stats: dict[str, dict[str, StatValue]],
                        cameras: Collection[str]) -> dict[str, dict[str, StatValue]]:
    """``stats`` with each camera's mean and std replaced by ImageNet's, as LeRobot's training does
    (``use_imagenet_stats``); the other statistics stay the dataset's."""
    out = {key: dict(per_key) for key, per_key in stats.items()}
    for key in cameras:
        out.setdefault(key, {}).update({name: torch.tensor(value) for name, value in IMAGENET_STATS.items()})
    return out


def _mode(value: str, feature_type: str) -> NormalizationMode:
    try:
        return NormalizationMode(value)
    except ValueError:
        raise config_error(f"policy.normalization_mapping.{feature_type}", value, "is not a normalisation mode "
                           "lerobot_mg implements", f"policy.normalization_mapping.{feature_type}=<one of "
                           f"{[mode.value for mode in NormalizationMode]}>") from None


class _NormalizationStep(ProcessorStep):
    """Holds the statistics of every dataset key; (un)normalises the ``features`` it was built for."""

    def __init__(
        self,
        features: dict[str, FeatureSpec],
        norm_map: dict[str, str],
        stats: dict[str, dict[str, StatValue]],
        eps: float = DEFAULT_EPS,
        normalize_observation_keys: Collection[str] | None = None,
    ) -> None:
        self.features = {
            key: {"type": str(spec["type"]), "shape": list(spec["shape"])} for key, spec in features.items()
        }
        self.norm_map = {str(key): str(value) for key, value in norm_map.items()}
        self.eps = eps
        self.normalize_observation_keys = (None if normalize_observation_keys is None
                                           else sorted(normalize_observation_keys))
        self.modes = {key: _mode(self.norm_map.get(spec["type"], NormalizationMode.IDENTITY.value), spec["type"])
                      for key, spec in self.features.items()}
        self.stats: dict[str, dict[str, Tensor]] = {
            key: {name: torch.as_tensor(value, dtype=torch.float32).clone() for name, value in per_key.items()}
            for key, per_key in stats.items()
        }
        for key, spec in self.features.items():  # LeRobot's broadcast shape for a camera's per-channel values
            if spec["type"] == FeatureType.VISUAL.value and key in self.stats:
                self.stats[key] = {name: value.reshape(-1, 1, 1) if value.dim() == 1 else value
                                   for name, value in self.stats[key].items()}
        for key in self.features:
            self._check_stats(key)

    def _check_stats(self, key: str) -> None:
        mode, feature_type, shape = self.modes[key], self.features[key]["type"], tuple(self.features[key]["shape"])
        for stat_name in STATS_PER_MODE[mode]:
            tensor = self.stats.get(key, {}).get(stat_name)
            if tensor is None:
                raise config_error(
                    f"policy.normalization_mapping.{feature_type}", mode.value,
                    f"needs the {stat_name!r} statistic of {key!r}, which the dataset's stats lack",
                    f"policy.normalization_mapping.{feature_type}=IDENTITY, or a dataset whose meta/stats.json "
                    "includes it",
                )
            try:
                broadcast = torch.broadcast_shapes(tensor.shape, shape)
            except RuntimeError:
                broadcast = None
            if broadcast != shape:
                raise config_error(
                    f"stats[{key!r}][{stat_name!r}].shape", tuple(tensor.shape),
                    f"does not broadcast to the feature shape {shape}; the stats belong to a different dataset",
                    "the stats of this dataset (its meta/stats.json), or the dataset they belong to (dataset.root)",
                )

    def _stat(self, key: str, stat_name: str, like: Tensor) -> Tensor:
        return self.stats[key][stat_name].to(device=like.device, dtype=like.dtype)

    def _low_range(self, key: str, mode: NormalizationMode, like: Tensor) -> tuple[Tensor, Tensor]:
        """(low, high - low) of a range mode (MIN_MAX: min and max, QUANTILES: q01 and q99, ...), a zero range
        replaced by eps (LeRobot's rule: a constant feature maps to -1)."""
        low_name, high_name = STATS_PER_MODE[mode]
        low = self._stat(key, low_name, like)
        denom = self._stat(key, high_name, like) - low
        return low, denom.masked_fill(denom == 0, self.eps)  # a Python float: nothing copied to the device

    @abc.abstractmethod
    def _apply(self, key: str, mode: NormalizationMode, x: Tensor) -> Tensor:
        """Transform one feature tensor in ``mode`` (never IDENTITY)."""

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        out = dict(batch)
        for key, mode in self.modes.items():
            if mode is NormalizationMode.IDENTITY or key not in batch:
                continue
            if (self.normalize_observation_keys is not None and self.features[key]["type"] != FeatureType.ACTION
                    and key not in self.normalize_observation_keys):
                continue
            x = batch[key]
            # At least float32: bf16 statistics would shift a normalised action by up to ~0.4% of its scale.
            if not torch.is_floating_point(x) or torch.finfo(x.dtype).bits < 32:
                x = x.to(torch.float32)
            out[key] = self._apply(key, mode, x)
        return out

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"eps": self.eps, "features": self.features, "norm_map": self.norm_map}
        if self.normalize_observation_keys is not None:
            config["normalize_observation_keys"] = self.normalize_observation_keys
        return config

    def state_dict(self) -> dict[str, Tensor]:
        return {f"{key}.{stat_name}": tensor for key, per_key in self.stats.items()
                for stat_name, tensor in per_key.items()}

    def to(self: NormStepT, device: torch.device | str) -> NormStepT:
        self.stats = {key: {name: value.to(device) for name, value in per_key.items()}
                      for key, per_key in self.stats.items()}
        return self

    @classmethod
    def from_config(cls: type[NormStepT], config: dict[str, Any], state: dict[str, Tensor]) -> NormStepT:
        stats: dict[str, dict[str, StatValue]] = {}
        for flat_key, tensor in state.items():
            # Feature keys contain dots themselves; the statistic name is the last component.
            key, stat_name = flat_key.rsplit(".", 1)
            stats.setdefault(key, {})[stat_name] = tensor
        return cls(config["features"], config["norm_map"], stats, eps=float(config.get("eps", DEFAULT_EPS)),
                   normalize_observation_keys=config.get("normalize_observation_keys"))


@register_step
class NormalizerStep(_NormalizationStep):
    registry_name: ClassVar[str] = "normalizer_processor"

    def _apply(self, key: str, mode: NormalizationMode, x: Tensor) -> Tensor:
        if mode is NormalizationMode.MEAN_STD:
            return (x - self._stat(key, "mean", x)) / (self._stat(key, "std", x) + self.eps)
        low, denom = self._low_range(key, mode, x)
        return 2 * (x - low) / denom - 1


@register_step
class UnnormalizerStep(_NormalizationStep):
    registry_name: ClassVar[str] = "unnormalizer_processor"

    def _apply(self, key: str, mode: NormalizationMode, x: Tensor) -> Tensor:
        if mode is NormalizationMode.MEAN_STD:
            return x * self._stat(key, "std", x) + self._stat(key, "mean", x)
        low, denom = self._low_range(key, mode, x)
        if mode is NormalizationMode.MIN_MAX:
            return (x + 1) / 2 * denom + low
        return (x + 1) * denom / 2 + low  # LeRobot's order of operations for the quantile modes: its rounding


def make_processors(
    policy_cfg: Any,
    input_features: dict[str, FeatureSpec],
    output_features: dict[str, FeatureSpec],
    stats: dict[str, dict[str, StatValue]],
    device: torch.device | str = "cpu",
) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """(preprocessor, postprocessor) of LeRobot's pipelines for a policy config carrying ``normalization_mapping``,
    with ``stats`` (every key's, camera mean/std already ImageNet's when wanted): ACT's and Diffusion's, or, for a
    config whose ``type`` is pi0, pi05 or smolvla, those of :mod:`lerobot_mg.processors.vla` (with the tokenizer)."""
    norm_map = {str(key): str(getattr(value, "value", value))
                for key, value in dict(policy_cfg.normalization_mapping).items()}
    if getattr(policy_cfg, "type", None) in VLA_TYPES:
        return vla_pipelines(policy_cfg, NormalizerStep({**input_features, **output_features}, norm_map, stats),
                             UnnormalizerStep(output_features, norm_map, stats), device)
    preprocessor = PolicyProcessorPipeline("policy_preprocessor", [
        RenameObservationsStep(), ToBatchStep(), DeviceStep(device),
        NormalizerStep({**input_features, **output_features}, norm_map, stats),
    ])
    postprocessor = PolicyProcessorPipeline("policy_postprocessor", [
        UnnormalizerStep(output_features, norm_map, stats), DeviceStep("cpu"),
    ])
    return preprocessor, postprocessor


def load_processors(directory: Path) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """(preprocessor, postprocessor) saved in a ``pretrained_model`` directory by lerobot_mg or LeRobot 0.6.1: the
    statistics a policy was trained with, for training on from it (resume, fine-tuning) and for running it."""
    pipelines = (PolicyProcessorPipeline.from_pretrained(directory, "policy_preprocessor"),
                 PolicyProcessorPipeline.from_pretrained(directory, "policy_postprocessor"))
    for pipeline, step_class in zip(pipelines, (NormalizerStep, UnnormalizerStep), strict=True):
        try:
            pipeline.step(step_class)
        except LookupError as error:
            raise ConfigError(f"{Path(directory) / pipeline.name}.json: {error}. Fix: a pretrained_model directory "
                              "of a policy lerobot_mg trains (LeRobot 0.6.1's or lerobot_mg's)") from None
    return pipelines


def processors_for(policy_cfg: Any, policy: Any, stats: dict[str, dict[str, StatValue]], saved_dir: Path | None,
                   imagenet_cameras: Collection[str] = (), saved_stats: bool = True,
                   ) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """A run's (preprocessor, postprocessor): new ones on this dataset's ``stats`` (the ``imagenet_cameras``'
    mean/std replaced by ImageNet's) when ``saved_dir`` is None; else those saved in ``saved_dir`` (the checkpoint
    it resumes, or the base it fine-tunes), with the statistics saved there when ``saved_stats`` (a resume, or
    ``dataset.use_base_stats``), else with this dataset's, as LeRobot's lerobot-train fine-tunes: the base's
    steps, tokenizer included, with the (un)normaliser rebuilt on this dataset's statistics and the policy's
    features and normalisation mapping."""
    dataset_stats = with_imagenet_stats(stats, imagenet_cameras)
    if saved_dir is None:
        return make_processors(policy_cfg, policy.input_features, policy.output_features, dataset_stats)
    pipelines = load_processors(saved_dir)
    if not saved_stats:
        norm_map = {str(key): str(getattr(value, "value", value))
                    for key, value in dict(policy_cfg.normalization_mapping).items()}
        features = ({**policy.input_features, **policy.output_features}, policy.output_features)
        for pipeline, step_class, step_features in zip(pipelines, (NormalizerStep, UnnormalizerStep), features,
                                                       strict=True):
            saved = pipeline.step(step_class)
            pipeline.steps[pipeline.steps.index(saved)] = step_class(
                step_features, norm_map, dataset_stats, eps=saved.eps,
                normalize_observation_keys=saved.normalize_observation_keys)
    return pipelines
