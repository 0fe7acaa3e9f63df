"""Policy registry: name -> class, building a policy from its config and loading a saved one."""

from __future__ import annotations

import importlib
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lerobot_mg.config.policy import PolicyConfig
from lerobot_mg.config.schema import policy_config_class
from lerobot_mg.policies.base import PreTrainedPolicy, features_from_dataset
from lerobot_mg.policies.saved_config import read_saved_policy


def get_policy_class(name: str) -> type[PreTrainedPolicy]:
    """The policy class of the config registered as ``name`` (its ``policy_class_path``). Its module is imported
    when the policy is first asked for, so that a run imports only its own policy's libraries (Diffusion Policy's
    diffusers schedulers cost every process about a second)."""
    module, class_name = policy_config_class(name).policy_class_path.split(":")  # refuses an unknown name
    return getattr(importlib.import_module(module), class_name)


def policy_config_from(cfg: Any) -> PolicyConfig:
    """The policy config as its dataclass, whether given as that dataclass or as a Hydra DictConfig."""
    if isinstance(cfg, DictConfig):
        policy_class = get_policy_class(str(cfg.type))
        return policy_class.config_class(**OmegaConf.to_container(cfg, resolve=True))
    if not is_dataclass(cfg):
        raise ValueError(f"Expected a policy config dataclass or DictConfig, got {type(cfg).__name__}.")
    return cfg


def make_policy(cfg: Any, dataset_features: dict[str, dict[str, Any]]) -> PreTrainedPolicy:
    """Validate `cfg` (policy config dataclass or DictConfig) and build a freshly initialised policy whose
    inputs are the dataset's observation features (all, or `cfg.observation_keys`)."""
    config = policy_config_from(cfg)
    policy_class = get_policy_class(config.type)
    if not isinstance(config, policy_class.config_class):
        raise ValueError(
            f"policy.type={config.type!r} expects {policy_class.config_class.__name__}, "
            f"got {type(config).__name__}."
        )
    config.validate()
    input_features, output_features = features_from_dataset(dataset_features, config.observation_keys)
    return policy_class(config, input_features, output_features)


def load_pretrained(directory: Path, map_location: str = "cpu") -> PreTrainedPolicy:
    """Load a ``pretrained_model`` directory holding a whole policy (config.json + model.safetensors, written by
    lerobot_mg or LeRobot 0.6.1), dispatching on config.json's ``type``. A PEFT run's directory (an adapter on a
    base) loads through :func:`lerobot_mg.peft.lora.load_policy`, which takes either kind."""
    saved = read_saved_policy(Path(directory))
    return get_policy_class(saved.type).from_pretrained(directory, map_location=map_location)
