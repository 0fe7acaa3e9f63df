"""Processor pipelines: an ordered list of steps applied to a batch dict, saved in LeRobot 0.6.1's files.

On disk, a pipeline named ``policy_preprocessor`` is ``policy_preprocessor.json``, ``json.dumps(..., indent=2)`` of
``{"name": ..., "steps": [{"registry_name": ..., "config": {...}, "state_file": ...}, ...]}`` (``state_file`` only
for a step with tensors), plus ``policy_preprocessor_step_<index>_<registry_name>.safetensors`` for each such step:
the files LeRobot's ``DataProcessorPipeline.save_pretrained`` writes, so LeRobot loads ours and we load LeRobot's.
A step is found by its ``registry_name``, LeRobot's name for it (``normalizer_processor``, ``device_processor``, ...).
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
from lerobot_mg.safe_paths import contained

PIPELINE_NAMES = ("policy_preprocessor", "policy_postprocessor")
# Step classes of the processor files lerobot_mg wrote before it wrote LeRobot's.
_OLD_STEP_CLASSES = ("NormalizerStep", "UnnormalizerStep")

StepT = TypeVar("StepT", bound="ProcessorStep")


class ProcessorStep(abc.ABC):
    """One transformation of a batch. Steps with tensors expose them through state_dict()."""

    registry_name: ClassVar[str]  # LeRobot's name of the step, the key of its entry in the pipeline json

    @abc.abstractmethod
    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Return a new batch dict; the input dict is left untouched."""

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable arguments that, with state_dict(), rebuild the step (LeRobot's ``config``)."""

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
    """Class decorator: make a step loadable by its ``registry_name`` from a pipeline json."""
    STEP_CLASSES[step_class.registry_name] = step_class
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

    def step(self, step_class: type[StepT]) -> StepT:
        """The pipeline's one step of ``step_class``."""
        found = [step for step in self.steps if isinstance(step, step_class)]
        if len(found) != 1:
            raise LookupError(f"{self.name} has {len(found)} {step_class.registry_name} steps, not one")
        return found[0]

    def state_file_name(self, index: int, step: ProcessorStep, stem: str | None = None) -> str:
        return f"{stem or self.name}_step_{index}_{step.registry_name}.safetensors"

    def save_pretrained(self, directory: Path, stem: str | None = None) -> None:
        """Write ``<stem>.json`` and its state files into ``directory``; ``stem`` defaults to the pipeline's name. A
        different stem (``policy_preprocessor_<source>``) writes a second pipeline beside the default pair: it loads
        with ``from_pretrained(directory, stem)`` here and LeRobot's ``from_pretrained(directory,
        config_filename="<stem>.json")``, and its ``name`` inside stays the pipeline's."""
        stem = stem or self.name
        if Path(stem).name != stem or stem in (".", ".."):
            raise ValueError(f"{stem!r} is not a file name")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        step_entries = []
        for index, step in enumerate(self.steps):
            entry: dict[str, Any] = {"registry_name": step.registry_name, "config": step.get_config()}
            state = step.state_dict()
            if state:
                entry["state_file"] = self.state_file_name(index, step, stem)
                tensors = {key: tensor.detach().cpu().contiguous() for key, tensor in state.items()}
                save_file(tensors, str(directory / entry["state_file"]))
            step_entries.append(entry)
        manifest = {"name": self.name, "steps": step_entries}
        (directory / f"{stem}.json").write_text(json.dumps(manifest, indent=2))

    @classmethod
    def from_pretrained(cls, directory: Path, name: str) -> PolicyProcessorPipeline:
        """The pipeline saved in ``directory`` by lerobot_mg or by LeRobot 0.6.1."""
        directory = Path(directory)
        manifest_path = directory / f"{name}.json"
        if not manifest_path.is_file():
            raise ConfigError(f"{directory}: holds no {manifest_path.name}. Fix: pass a pretrained_model directory "
                              "(<run>/checkpoints/<step or last>/pretrained_model)")
        manifest = json.loads(manifest_path.read_text())
        steps: list[ProcessorStep] = []
        for index, entry in enumerate(manifest["steps"]):
            if entry.get("class") in _OLD_STEP_CLASSES:
                raise ConfigError(
                    f"{manifest_path}: was written by a lerobot_mg older than its LeRobot 0.6.1 checkpoint format "
                    "(steps named by 'class'), and so were the policy weights beside it, under names the policies "
                    "no longer have. Fix: train the checkpoint again with this lerobot_mg (or start from a LeRobot "
                    "0.6.1 pretrained_model with policy.path)"
                )
            step_name = entry.get("registry_name", entry.get("class"))
            step_class = STEP_CLASSES.get(step_name)
            if step_class is None:
                raise ConfigError(
                    f"{manifest_path}: uses the processor step {step_name!r}, which lerobot_mg does not have (it "
                    f"has {sorted(STEP_CLASSES)}). Fix: a pretrained_model directory of a policy lerobot_mg trains "
                    "(ACT, Diffusion, pi0, pi0.5, SmolVLA: LeRobot 0.6.1's or lerobot_mg's)"
                )
            state = {}
            if entry.get("state_file"):  # kept inside the directory: the manifest may come from someone else
                state = load_file(str(contained(directory, entry["state_file"], manifest_path,
                                                f"steps[{index}].state_file")))
            steps.append(step_class.from_config(entry.get("config", {}), state))
        return cls(manifest["name"], steps)
