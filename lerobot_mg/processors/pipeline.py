"""Processor pipelines: an ordered list of steps applied to a batch dict, saved as json + safetensors.

On disk, a pipeline named `policy_preprocessor` is `policy_preprocessor.json` (the steps, their classes
and configs) plus `policy_preprocessor_step_{i}_{step.name}.safetensors` for every step with state.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from lerobot_mg.errors import ConfigError

PIPELINE_NAMES = ("policy_preprocessor", "policy_postprocessor")

StepT = TypeVar("StepT", bound="ProcessorStep")


class ProcessorStep(abc.ABC):
    """One transformation of a batch. Steps with tensors expose them through state_dict()."""

    name: ClassVar[str]

    @abc.abstractmethod
    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Return a new batch dict; the input dict is left untouched."""

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable arguments that, with state_dict(), rebuild the step."""

    def state_dict(self) -> dict[str, Tensor]:
        return {}

    def to(self: StepT, device: torch.device | str) -> StepT:
        return self

    @classmethod
    @abc.abstractmethod
    def from_config(cls: type[StepT], config: dict[str, Any], state: dict[str, Tensor]) -> StepT:
        """Inverse of (get_config(), state_dict())."""


STEP_CLASSES: dict[str, type[ProcessorStep]] = {}


def register_step(step_class: type[StepT]) -> type[StepT]:
    """Class decorator: make a step loadable by its class name from a pipeline json."""
    STEP_CLASSES[step_class.__name__] = step_class
    return step_class


class PolicyProcessorPipeline:
    def __init__(self, name: str, steps: list[ProcessorStep]) -> None:
        if name not in PIPELINE_NAMES:
            raise ValueError(f"Pipeline name {name!r} is not one of {list(PIPELINE_NAMES)}.")
        self.name = name
        self.steps = list(steps)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        for step in self.steps:
            batch = step(batch)
        return batch

    def to(self, device: torch.device | str) -> PolicyProcessorPipeline:
        for step in self.steps:
            step.to(device)
        return self

    def _state_file_name(self, index: int, step: ProcessorStep) -> str:
        return f"{self.name}_step_{index}_{step.name}.safetensors"

    def save_pretrained(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        step_entries = []
        for index, step in enumerate(self.steps):
            state = step.state_dict()
            state_file = None
            if state:
                state_file = self._state_file_name(index, step)
                tensors = {key: tensor.detach().cpu().contiguous() for key, tensor in state.items()}
                save_file(tensors, str(directory / state_file))
            step_entries.append(
                {
                    "name": step.name,
                    "class": type(step).__name__,
                    "config": step.get_config(),
                    "state_file": state_file,
                }
            )
        manifest = {"name": self.name, "steps": step_entries}
        (directory / f"{self.name}.json").write_text(json.dumps(manifest, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: Path, name: str) -> PolicyProcessorPipeline:
        directory = Path(directory)
        manifest_path = directory / f"{name}.json"
        if not manifest_path.is_file():
            raise ConfigError(f"{directory}: holds no {manifest_path.name}. Fix: pass a pretrained_model directory "
                              "(<run>/checkpoints/<step or last>/pretrained_model)")
        manifest = json.loads(manifest_path.read_text())
        steps: list[ProcessorStep] = []
        for entry in manifest["steps"]:
            step_class = STEP_CLASSES.get(entry["class"])
            if step_class is None:
                raise ConfigError(
                    f"{manifest_path}: uses step class {entry['class']!r}; known classes: {sorted(STEP_CLASSES)}. "
                    "Fix: a pretrained_model directory saved by this lerobot_mg"
                )
            state = load_file(str(directory / entry["state_file"])) if entry["state_file"] else {}
            steps.append(step_class.from_config(entry["config"], state))
        return cls(manifest["name"], steps)
