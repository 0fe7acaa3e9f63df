from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from lerobot_mg.policies.base import FeatureSpec, PreTrainedPolicy, delta_timestamps, features_from_dataset
from lerobot_mg.policies.diffusion import DiffusionConfig, DiffusionPolicy
from lerobot_mg.policies.registry import POLICIES, get_policy_class, load_pretrained, make_policy

__all__ = [
    "POLICIES",
    "ACTConfig",
    "ACTPolicy",
    "DiffusionConfig",
    "DiffusionPolicy",
    "FeatureSpec",
    "PreTrainedPolicy",
    "delta_timestamps",
    "features_from_dataset",
    "get_policy_class",
    "load_pretrained",
    "make_policy",
]
