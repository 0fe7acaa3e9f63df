"""Processor pipelines between a dataset's batches and a policy: normalisation in, unnormalisation out."""

from lerobot_mg.processors.normalize import (
    NormalizerStep,
    UnnormalizerStep,
    load_processors,
    make_processors,
    processors_for,
)
from lerobot_mg.processors.pipeline import PolicyProcessorPipeline, ProcessorStep, register_step

__all__ = [
    "NormalizerStep",
    "PolicyProcessorPipeline",
    "ProcessorStep",
    "UnnormalizerStep",
    "load_processors",
    "make_processors",
    "processors_for",
    "register_step",
]
