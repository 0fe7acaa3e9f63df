"""The allowed values of the config fields that take one of a fixed set.

Each is a ``str`` enum whose member names are their values, so a YAML preset or a command line writes the plain word
(``checkpoint.format=dcp``) and Hydra refuses any other word at compose time, listing the allowed ones. A member
compares equal to its string and prints as it (``f"{CheckpointFormat.dcp}"`` is ``dcp``), so JSON files and
messages keep the words users type.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """Base of the choice enums: prints and formats as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

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


class TorchDtype(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class DatasetName(Choice):
    embedded = "embedded"  # the ALOHA transfer-cube demos lerobot-mg-make-dataset generates
    lerobot = "lerobot"  # any LeRobot v3.0 dataset directory


class SchedulerType(Choice):
    none = "none"
    constant = "constant"
    cosine = "cosine"


class OptimizerType(Choice):
    adamw = "adamw"


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"
