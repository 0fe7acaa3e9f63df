"""The policies (ACT, Diffusion Policy) with LeRobot 0.6.1's parameter names, and the registry that builds and loads
them. Each policy lives in its own subpackage (``lerobot_mg.policies.act``, ``lerobot_mg.policies.diffusion``),
imported where it is used: the registry imports a policy's module only when that policy is asked for."""

from lerobot_mg.policies.base import FeatureSpec, PreTrainedPolicy, delta_timestamps, features_from_dataset
from lerobot_mg.policies.registry import get_policy_class, load_pretrained, make_policy

__all__ = [
    "FeatureSpec",
    "PreTrainedPolicy",
    "delta_timestamps",
    "features_from_dataset",
    "get_policy_class",
    "load_pretrained",
    "make_policy",
]
