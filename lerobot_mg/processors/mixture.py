"""Normalising the samples of a dataset mixture: with the merged statistics or with each source's own, through one
normaliser that LeRobot's loader reads.

A mixture's processor files (``policy_preprocessor.json``, ``policy_postprocessor.json``) hold one set of
statistics, the sources' merged ones (:func:`lerobot_mg.data.stats.aggregate_stats`), whichever ``dataset.stats``
is. Before the normaliser sees a sample, the mixture dataset's ``collate`` (the DataLoader's, which zero-pads each
sample's state and action to the policy's length) maps those vectors with its source's :class:`SourceAffine`
(:func:`source_affine`, handed to the dataset by :func:`normalise_sources`):

- ``dataset.stats=merged``: unchanged; the merged normaliser normalises every source alike.
- ``dataset.stats=per_source``: ``y = (x - offset) * scale + shift``, chosen so that the merged normaliser gives
  for ``y`` exactly what the source's own statistics give for ``x`` (MEAN_STD: ``(x - mean_s) / (std_s + eps)``;
  MIN_MAX and the quantile modes: ``2 (x - low_s) / (high_s - low_s) - 1``).

Either way, the dimensions a source lacks (its vector is shorter than the policy's feature: a 2-dim PushT action
beside a 14-dim ALOHA one) are set to the value the merged normaliser maps to 0 (its mean, its range's middle; the
low end, normalised to -1 as every sample there, where the merged range is zero). Cameras are left as they are.

A policy trained per source runs on each source's robot with that source's statistics: :func:`source_processors`
makes the pair of pipelines that normalise with them (the run's pipelines, the (un)normaliser's vector statistics
replaced by the source's, lengthened by :func:`lerobot_mg.data.stats.pad_stats` so the padded dimensions pass
unchanged), and :func:`save_source_processors` writes them beside the default pair as
``policy_preprocessor_<source>.json`` / ``policy_postprocessor_<source>.json`` with their state files. LeRobot reads
them with ``PolicyProcessorPipeline.from_pretrained(<pretrained_model>,
config_filename="policy_preprocessor_<source>.json")``; lerobot_mg with :func:`load_source_processors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lerobot_mg.config.choices import FeatureType, MixtureStats, NormalizationMode
from lerobot_mg.data.mixture import MixtureDataset
from lerobot_mg.data.stats import StatsLike, pad_stats
from lerobot_mg.processors.normalize import STATS_PER_MODE, NormalizerStep, UnnormalizerStep
from lerobot_mg.processors.pipeline import PIPELINE_NAMES, PolicyProcessorPipeline


@dataclass(frozen=True)
class SourceAffine:
    """One source's map of its state and action vectors before the merged normaliser (see the module docstring):
    per feature key, float32 vectors of the policy's feature length. :meth:`MixtureDataset.collate
    <lerobot_mg.data.mixture.MixtureDataset.collate>` applies it to each sample of a batch, its vectors zero-padded
    to that length first: ``(x - offset) * scale + shift``."""

    offset: dict[str, np.ndarray]
    scale: dict[str, np.ndarray]
    shift: dict[str, np.ndarray]


def _effective_mode(step: NormalizerStep, key: str) -> NormalizationMode:
    """The mode the normaliser applies to ``key``: IDENTITY for an observation it was told to leave."""
    keys = step.normalize_observation_keys
    if keys is not None and step.features[key]["type"] != FeatureType.ACTION.value and key not in keys:
        return NormalizationMode.IDENTITY
    return step.modes[key]


def _float32_values(value: Any, length: int) -> np.ndarray:
    """A statistic's first ``length`` values as the normaliser holds them (float32), in float64."""
    return np.asarray(torch.as_tensor(value, dtype=torch.float32).detach().cpu(), dtype=np.float64).reshape(-1)[:length]


def _terms(stats: Mapping[str, Any], mode: NormalizationMode, eps: float, length: int,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(center, width, zero) of a mode, float64: the normaliser maps ``x`` to ``k (x - center) / width + b``
    (MEAN_STD and IDENTITY: k=1, b=0; the range modes: k=2, b=-1) and ``zero`` to 0 (a zero range, counted as eps:
    to -1, its low end)."""
    if mode is NormalizationMode.IDENTITY:
        return np.zeros(length), np.ones(length), np.zeros(length)
    low, high = (_float32_values(stats[name], length) for name in STATS_PER_MODE[mode])
    if mode is NormalizationMode.MEAN_STD:
        return low, high + eps, low
    width = np.where(high == low, eps, high - low)
    return low, width, np.where(high == low, low, low + width / 2)


def _source_length(source_stats: StatsLike, key: str) -> int:
    values = [value for name, value in source_stats.get(key, {}).items() if name != "count"]
    return int(np.shape(values[0])[-1]) if values else 0


def source_affine(preprocessor: PolicyProcessorPipeline, source_stats: StatsLike, *, per_source: bool,
                  ) -> SourceAffine:
    """The :class:`SourceAffine` of one source for the run's ``preprocessor`` (whose normaliser holds the merged
    statistics): ``per_source`` (``dataset.stats=per_source``) maps the source's vectors so that the normaliser
    gives what ``source_stats`` (the source's own statistics, keyed as the normaliser's features) would; else
    only the dimensions the source lacks are set. A feature's length in the source is that of its statistics (none:
    every dimension is padding). Covers every non-camera feature the normaliser has."""
    step = preprocessor.step(NormalizerStep)
    offset, scale, shift = {}, {}, {}
    for key, spec in step.features.items():
        if spec["type"] == FeatureType.VISUAL.value:
            continue
        if len(spec["shape"]) != 1:
            raise ValueError(f"{key!r}: a feature of shape {spec['shape']} is not a vector")
        full, mode = int(spec["shape"][0]), _effective_mode(step, key)
        n = _source_length(source_stats, key)
        if n > full:
            raise ValueError(f"{key!r}: the source's statistics have {n} values, the policy's feature {full}")
        center, width, zero = _terms(step.stats.get(key, {}), mode, step.eps, full)
        key_offset, key_scale, key_shift = np.zeros(full), np.zeros(full), zero.copy()
        if per_source:
            own_center, own_width, _ = _terms(source_stats[key], mode, step.eps, n) if n else (0.0, 1.0, 0.0)
            key_offset[:n], key_scale[:n], key_shift[:n] = own_center, width[:n] / own_width, center[:n]
        else:
            key_scale[:n], key_shift[:n] = 1.0, 0.0
        offset[key], scale[key], shift[key] = (a.astype(np.float32) for a in (key_offset, key_scale, key_shift))
    return SourceAffine(offset, scale, shift)


def _with_source_stats(pipeline: PolicyProcessorPipeline, step_class: type[NormalizerStep] | type[UnnormalizerStep],
                       source_stats: StatsLike, vectors: dict[str, int]) -> PolicyProcessorPipeline:
    step = pipeline.step(step_class)
    own = {key: source_stats[key] if key in source_stats else  # a feature the source lacks: all padding
           {**{name: np.zeros(0, np.float32) for name in step.stats.get(key, {}) if name != "count"},
            "count": np.zeros(1, np.float32)} for key in vectors}
    stats = {key: {name: value.detach().cpu() for name, value in per_key.items()}
             for key, per_key in step.stats.items()}
    stats.update({key: {name: torch.as_tensor(value, dtype=torch.float32) for name, value in per_key.items()}
                  for key, per_key in pad_stats(own, vectors).items()})
    state = {f"{key}.{name}": value for key, per_key in stats.items() for name, value in per_key.items()}
    replaced = step_class.from_config(step.get_config(), state)
    return PolicyProcessorPipeline(pipeline.name, [replaced if other is step else other for other in pipeline.steps])


def source_processors(preprocessor: PolicyProcessorPipeline, postprocessor: PolicyProcessorPipeline,
                      source_stats: StatsLike) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """The run's (preprocessor, postprocessor) normalising with one source's statistics: the same steps, the
    (un)normaliser's statistics of every non-camera feature replaced by ``source_stats``' padded to the policy's
    lengths (:func:`lerobot_mg.data.stats.pad_stats`: the padded dimensions pass unchanged, so a robot's vector
    zero-padded to the policy's length is normalised as in training); the camera statistics stay the run's."""
    vectors = {key: int(spec["shape"][0]) for key, spec in preprocessor.step(NormalizerStep).features.items()
               if spec["type"] != FeatureType.VISUAL.value}  # the same statistics in both files
    return (_with_source_stats(preprocessor, NormalizerStep, source_stats, vectors),
            _with_source_stats(postprocessor, UnnormalizerStep, source_stats, vectors))


def source_file_stem(pipeline_name: str, source: str) -> str:
    """``policy_preprocessor_<source>``: the name of one source's pipeline files in a ``pretrained_model``
    directory."""
    return f"{pipeline_name}_{source}"


def save_source_processors(directory: Path, source: str,
                           pipelines: tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]) -> None:
    """Write one source's (preprocessor, postprocessor) (:func:`source_processors`) into ``directory`` (a
    ``pretrained_model``) as ``policy_preprocessor_<source>.json`` / ``policy_postprocessor_<source>.json`` and
    their state files ``policy_preprocessor_<source>_step_<index>_<registry_name>.safetensors``."""
    for pipeline in pipelines:
        pipeline.save_pretrained(directory, source_file_stem(pipeline.name, source))


def load_source_processors(directory: Path, source: str) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """One source's (preprocessor, postprocessor) saved by :func:`save_source_processors`."""
    pre, post = (PolicyProcessorPipeline.from_pretrained(directory, source_file_stem(name, source))
                 for name in PIPELINE_NAMES)
    return pre, post


def normalise_sources(mixture: MixtureDataset, preprocessor: PolicyProcessorPipeline,
                      postprocessor: PolicyProcessorPipeline, mode: MixtureStats,
                      ) -> dict[str, tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]]:
    """Give each source of ``mixture`` its map into the run's normaliser (``preprocessor``, on the CPU: the merged
    statistics) for ``dataset.stats=mode``; returns, for ``per_source``, each source's pipelines by name (the files a
    checkpoint holds beside the default pair), else none."""
    per_source = mode is MixtureStats.per_source
    mixture.set_normalisation([source_affine(preprocessor, stats, per_source=per_source)
                               for stats in mixture.source_stats])
    if not per_source:
        return {}
    return {source.name: source_processors(preprocessor, postprocessor, stats)
            for source, stats in zip(mixture.plan.sources, mixture.source_stats)}
