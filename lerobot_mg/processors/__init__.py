from lerobot_mg.processors.normalize import NormalizerStep, UnnormalizerStep, make_processors
from lerobot_mg.processors.pipeline import PolicyProcessorPipeline, ProcessorStep, register_step

__all__ = [
    "NormalizerStep",
    "PolicyProcessorPipeline",
    "ProcessorStep",
    "UnnormalizerStep",
    "make_processors",
    "register_step",
]
