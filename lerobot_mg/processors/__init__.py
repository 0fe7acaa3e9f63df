"""Processor pipelines between a dataset's batches and a policy, in LeRobot 0.6.1's files: normalisation in,
unnormalisation out."""

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

__all__ = [
    "IMAGENET_STATS",
    "DeviceStep",
    "NormalizerStep",
    "PolicyProcessorPipeline",
    "ProcessorStep",
    "RenameObservationsStep",
    "ToBatchStep",
    "UnnormalizerStep",
    "camera_keys",
    "load_processors",
    "make_processors",
    "processors_for",
    "register_step",
    "with_imagenet_stats",
]
