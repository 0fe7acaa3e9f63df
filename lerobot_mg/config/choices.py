"""The allowed values of the config fields that take one of a fixed set.

Each is a ``str`` enum whose member names are their values, so a YAML preset or a command line writes the plain word
(``checkpoint.format=dcp``) and Hydra refuses any other word at compose time, listing the allowed ones. A member
compares equal to its string, hashes like it, and prints and reprs as it (``f"{CheckpointFormat.dcp!r}"`` is
``'dcp'``), so JSON files and messages keep the words users type.
"""

from __future__ import annotations

from enum import Enum

from lerobot_mg.errors import ConfigError, config_error


class Choice(str, Enum):
    """Base of the choice enums: prints and formats as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:  # a message's `key={value!r}` shows the word typed, as for a plain string
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class MixedPrecision(Choice):
    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


class CheckpointFormat(Choice):
    """``safetensors``: one gathered model.safetensors. ``dcp``: per-rank shards (sharded runs). ``safetensors_dcp``:
    both."""

    safetensors = "safetensors"
    dcp = "dcp"
    safetensors_dcp = "safetensors_dcp"

    @property
    def writes_safetensors(self) -> bool:
        return self is not CheckpointFormat.dcp

    @property
    def writes_dcp(self) -> bool:
        return self is not CheckpointFormat.safetensors


class BestMetric(Choice):
    """What ``checkpoint.keep_best`` ranks checkpoints by: the success rate in simulation (higher is better) or the
    loss on ``dataset.val_episodes`` (lower is better)."""

    success_rate = "success_rate"
    val_loss = "val_loss"

    @property
    def higher_is_better(self) -> bool:
        return self is BestMetric.success_rate


class TorchDtype(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class DatasetName(Choice):
    embedded = "embedded"  # the ALOHA transfer-cube demos lerobot-mg-make-dataset generates
    lerobot = "lerobot"  # any LeRobot v3.0 dataset directory
    mixture = "mixture"  # several LeRobot datasets drawn by weight (dataset.sources)


class MixtureStats(Choice):
    """How a mixture's samples are normalised (``dataset.stats``)."""

    merged = "merged"  # one set of statistics over every source, as LeRobot's aggregate_stats merges them
    per_source = "per_source"  # each sample with its own source's statistics


class SchedulerType(Choice):
    none = "none"
    constant = "constant"
    cosine = "cosine"
    diffuser_cosine = "diffuser_cosine"  # LeRobot's `diffuser` scheduler named `cosine` (Diffusion's preset)
    cosine_decay_with_warmup = "cosine_decay_with_warmup"  # LeRobot's (pi0, pi0.5, SmolVLA)


class OptimizerType(Choice):
    adamw = "adamw"
    adam = "adam"  # weight decay as an L2 penalty (LeRobot's Diffusion preset)


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


# --- policy fields ---------------------------------------------------------------------------------------------


class FeatureType(Choice):
    """What a dataset feature is to a policy: its keys in ``policy.normalization_mapping``."""

    VISUAL = "VISUAL"
    STATE = "STATE"
    ENV = "ENV"
    ACTION = "ACTION"


class NormalizationMode(Choice):
    """``MEAN_STD``: zero mean, unit variance. ``MIN_MAX``: min and max to [-1, 1]. ``QUANTILES``: the 1st and 99th
    percentiles (q01, q99) to [-1, 1] (pi0.5's default). ``QUANTILE10``: the 10th and 90th (q10, q90) to [-1, 1].
    ``IDENTITY``: unchanged."""

    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    QUANTILES = "QUANTILES"
    QUANTILE10 = "QUANTILE10"
    IDENTITY = "IDENTITY"


class Activation(Choice):
    relu = "relu"
    gelu = "gelu"


class VisionBackbone(Choice):
    """``resnet18``: torchvision's ResNet18 with its parameter names, as LeRobot builds it. ``lerobot_mg_cnn``: our
    small ResNet-style CNN (``policy.vision_channels``), trained from scratch; its checkpoints are lerobot_mg's only."""

    resnet18 = "resnet18"
    lerobot_mg_cnn = "lerobot_mg_cnn"


class L1Reduction(Choice):
    """How ACT's L1 loss averages a batch. ``valid_entries``: over the non-padded entries only (LeRobot 0.6.1).
    ``per_sample``: padded entries count as zero error and every sample weighs the same, so the mean of
    data-parallel ranks' losses equals one process's loss on the whole batch, whatever the padding per rank."""

    valid_entries = "valid_entries"
    per_sample = "per_sample"


class NoiseScheduler(Choice):
    DDPM = "DDPM"
    DDIM = "DDIM"


class BetaSchedule(Choice):
    linear = "linear"
    scaled_linear = "scaled_linear"
    squaredcos_cap_v2 = "squaredcos_cap_v2"


class PredictionType(Choice):
    epsilon = "epsilon"
    sample = "sample"


def choice_error(key: str, value: object, choices: type[Enum]) -> ConfigError:
    """``key=value`` is none of ``choices``: the allowed words, and as the fix the one that matches ignoring case
    (``DCP`` -> ``dcp``), else the first. The words are the members' names, which is what OmegaConf accepts."""
    names = [member.name for member in choices]
    fix = next((name for name in names if name.lower() == str(value).lower()), names[0])
    return config_error(key, value, f"must be one of {', '.join(names)}", f"{key}={fix}")


def check_choice(key: str, value: object, choices: type[Enum]) -> None:
    """Raise :func:`choice_error` unless ``value`` is one of ``choices`` (a config built in Python, or read from a
    JSON file, is not checked by OmegaConf)."""
    if value not in [member.value for member in choices]:
        raise choice_error(key, value, choices)
