"""The pre/post-processor pipelines of LeRobot 0.6.1's vision-language-action policies, step for step.

Preprocessor (the normaliser's place differs, and so does the index in its state file's name):

- pi0: rename, to_batch, ``pi0_new_line_processor``, ``tokenizer_processor``, device,
  ``relative_actions_processor``, normalizer
- pi0.5: rename, to_batch, ``relative_actions_processor``, normalizer,
  ``pi05_prepare_state_tokenizer_processor_step`` (the normalised state in the prompt), ``tokenizer_processor``,
  device
- SmolVLA: rename, to_batch, ``smolvla_new_line_processor``, ``tokenizer_processor``, device, normalizer

Postprocessor: unnormalizer, (pi0 and pi0.5: ``absolute_actions_processor``), device (to the CPU).

The tokenizer is read from the policy config by field name (:func:`configured_tokenizer`), the rest from LeRobot's
fields: ``tokenizer_max_length``, SmolVLA's ``pad_language_to``, pi0's ``use_relative_actions``,
``relative_exclude_joints`` and ``action_feature_names``.

LeRobot's relative actions (``policy.use_relative_actions``: the model learns actions minus the current state, the
postprocessor adds it back) are off by default; their two steps are kept in the files, disabled, so LeRobot reads
ours. lerobot_mg does not train with them on, and refuses a policy or a saved pipeline that turns them on.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from lerobot_mg.errors import config_error
from lerobot_mg.processors.language import (
    Pi0NewLineStep,
    Pi05StatePromptStep,
    SmolVLANewLineStep,
    TokenizerStep,
)
from lerobot_mg.processors.pipeline import PolicyProcessorPipeline, ProcessorStep, register_step
from lerobot_mg.processors.steps import DeviceStep, RenameObservationsStep, ToBatchStep
from lerobot_mg.processors.tokenizer_source import configured_tokenizer

VLA_TYPES = ("pi0", "pi05", "smolvla")


def _refuse_relative_actions(enabled: bool) -> None:
    if enabled:
        raise config_error("policy.use_relative_actions", True, "lerobot_mg does not train or run relative actions "
                           "(LeRobot's actions minus the current state)", "policy.use_relative_actions=false")


@register_step
class RelativeActionsStep(ProcessorStep):
    """LeRobot's ``relative_actions_processor``, disabled: passes the batch on; its settings are kept for the file."""

    registry_name: ClassVar[str] = "relative_actions_processor"

    def __init__(self, enabled: bool = False, exclude_joints: list[str] | None = None,
                 action_names: list[str] | None = None) -> None:
        _refuse_relative_actions(enabled)
        self.enabled = enabled
        self.exclude_joints = list(exclude_joints or [])
        self.action_names = None if action_names is None else list(action_names)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    def get_config(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "exclude_joints": self.exclude_joints, "action_names": self.action_names}

    @classmethod
    def from_config(cls, config: dict[str, Any], state: dict[str, Tensor]) -> RelativeActionsStep:
        return cls(bool(config.get("enabled", False)), config.get("exclude_joints"), config.get("action_names"))


@register_step
class AbsoluteActionsStep(ProcessorStep):
    """LeRobot's ``absolute_actions_processor`` (the inverse of the relative step), disabled: passes the batch on."""

    registry_name: ClassVar[str] = "absolute_actions_processor"

    def __init__(self, enabled: bool = False) -> None:
        _refuse_relative_actions(enabled)
        self.enabled = enabled

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    def get_config(self) -> dict[str, Any]:
        return {"enabled": self.enabled}

    @classmethod
    def from_config(cls, config: dict[str, Any], state: dict[str, Tensor]) -> AbsoluteActionsStep:
        return cls(bool(config.get("enabled", False)))


def _tokenizer_step(policy_cfg: Any) -> TokenizerStep:
    configured = configured_tokenizer(policy_cfg)
    assert configured is not None, policy_cfg.type
    key, name = configured
    padding = str(policy_cfg.pad_language_to) if policy_cfg.type == "smolvla" else "max_length"
    return TokenizerStep(name, max_length=policy_cfg.tokenizer_max_length, padding_side="right", padding=padding,
                         source_key=key)


def vla_pipelines(policy_cfg: Any, normalizer: ProcessorStep, unnormalizer: ProcessorStep,
                  device: Any = "cpu") -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """(preprocessor, postprocessor) of a pi0, pi0.5 or SmolVLA config around its (un)normaliser, in LeRobot's
    order (see the module docstring)."""
    to_device, to_cpu = DeviceStep(device), DeviceStep("cpu")
    head: list[ProcessorStep] = [RenameObservationsStep(), ToBatchStep()]
    if policy_cfg.type == "smolvla":
        pre = [*head, SmolVLANewLineStep(), _tokenizer_step(policy_cfg), to_device, normalizer]
        post = [unnormalizer, to_cpu]
    else:
        relative = RelativeActionsStep(bool(policy_cfg.use_relative_actions),
                                       list(getattr(policy_cfg, "relative_exclude_joints", None) or []),
                                       getattr(policy_cfg, "action_feature_names", None))
        if policy_cfg.type == "pi0":
            pre = [*head, Pi0NewLineStep(), _tokenizer_step(policy_cfg), to_device, relative, normalizer]
        else:
            pre = [*head, relative, normalizer, Pi05StatePromptStep(), _tokenizer_step(policy_cfg), to_device]
        post = [unnormalizer, AbsoluteActionsStep(relative.enabled), to_cpu]
    return PolicyProcessorPipeline("policy_preprocessor", pre), PolicyProcessorPipeline("policy_postprocessor", post)
