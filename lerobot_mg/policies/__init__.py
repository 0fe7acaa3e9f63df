from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from lerobot_mg.policies.base import FeatureSpec, PreTrainedPolicy, features_from_dataset
from lerobot_mg.policies.registry import POLICIES, get_policy_class, load_policy, make_policy

__all__ = [
    "POLICIES",
    "ACTConfig",
    "ACTPolicy",
    "FeatureSpec",
    "PreTrainedPolicy",
    "features_from_dataset",
    "get_policy_class",
    "load_policy",
    "make_policy",
]
