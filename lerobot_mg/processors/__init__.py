"""Processor pipelines between a dataset's batches and a policy, in LeRobot 0.6.1's files: normalisation in,
unnormalisation out, and for the vision-language-action policies (pi0, pi0.5, SmolVLA) the task instruction turned
into the prompt's tokens."""

from lerobot_mg.processors.language import (
    Pi0NewLineStep,
    Pi05StatePromptStep,
    SmolVLANewLineStep,
    TokenizerStep,
)
from lerobot_mg.processors.normalize import (
    IMAGENET_STATS,
    NormalizerStep,
    UnnormalizerStep,
    camera_keys,
    load_processors,
    make_processors,
    processors_for,
    with_imagenet_stats,
)
from lerobot_mg.processors.pipeline import PolicyProcessorPipeline, ProcessorStep, register_step
from lerobot_mg.processors.steps import DeviceStep, RenameObservationsStep, ToBatchStep
from lerobot_mg.processors.tokenizer_source import check_tokenizers
from lerobot_mg.processors.vla import AbsoluteActionsStep, RelativeActionsStep

__all__ = [
    "IMAGENET_STATS",
    "AbsoluteActionsStep",
    "DeviceStep",
    "NormalizerStep",
    "Pi05StatePromptStep",
    "Pi0NewLineStep",
    "PolicyProcessorPipeline",
    "ProcessorStep",
    "RelativeActionsStep",
    "RenameObservationsStep",
    "SmolVLANewLineStep",
    "ToBatchStep",
    "TokenizerStep",
    "UnnormalizerStep",
    "camera_keys",
    "check_tokenizers",
    "load_processors",
    "make_processors",
    "processors_for",
    "register_step",
    "with_imagenet_stats",
]
