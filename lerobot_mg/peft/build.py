"""The policy a run trains: fresh, the base at ``policy.path`` (plain fine-tuning), or that base under LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.peft.base import (
    BaseWeights,
    base_features,
    base_lineage,
    check_dataset_matches,
    check_policy_path,
    stored_dtype,
)
from lerobot_mg.peft.lora import load_policy, resolve_targets, wrap_with_lora
from lerobot_mg.policies.base import CONFIG_NAME, PreTrainedPolicy, load_state_dict_strictly
from lerobot_mg.policies.registry import get_policy_class, make_policy


def build_policy(cfg: TrainConfig, dataset_features: dict[str, dict[str, Any]], weights: bool = True) -> nn.Module:
    """The run's policy. ``weights=False`` leaves a base's weights unread (its dtype is still taken): what a
    meta-device build for the checks and the memory plan needs."""
    if cfg.policy.path is None:
        return make_policy(cfg.policy, dataset_features)
    check_dataset_matches(cfg.policy.path, dataset_features)
    policy = load_base_policy(cfg.policy, cfg.policy.path, weights)
    return wrap_with_lora(policy, cfg.peft, cfg.policy.path, cfg.policy.pretrained_path) if cfg.peft.enabled else policy


def load_base_policy(policy_cfg: Any, path: str, weights: bool = True) -> PreTrainedPolicy:
    """The policy of ``policy_cfg`` (the base's config with this run's overrides), on the base's features, with
    the base's weights in the dtype they were stored in (``weights=False``: the dtype only). Trains from here
    (train mode)."""
    inputs, outputs = base_features(path)
    # The base holds the backbone's weights: pretrained_backbone_weights is not read (nor downloaded).
    policy = get_policy_class(policy_cfg.type)(policy_cfg, inputs, outputs, load_backbone_weights=False)
    if not weights:
        policy.to(stored_dtype(path))
    elif check_policy_path(path) is BaseWeights.FULL:
        policy.load_weights(Path(path))
    else:
        merged = load_policy(Path(path), merge_adapter=True)
        policy.to(next(merged.parameters()).dtype)
        load_state_dict_strictly(policy, merged.state_dict(), f"{path} (the adapter merged into its base)",
                                 str(Path(path) / CONFIG_NAME))
    policy.train()
    return policy


def processors_dir(cfg: TrainConfig, resume_dir: Path | None) -> Path | None:
    """Where this run's normalisation comes from: the checkpoint it resumes, else the base it fine-tunes (the
    statistics the base was trained with), else None (this dataset's statistics)."""
    if resume_dir is not None:
        return resume_dir / L.PRETRAINED_MODEL_DIR
    return Path(cfg.policy.path) if cfg.policy.path is not None else None


def describe_finetune(cfg: TrainConfig, policy: nn.Module) -> dict[str, Any]:
    """The ledger's and banner's facts about what trains: parameter counts, the base, the PEFT settings."""
    facts: dict[str, Any] = {
        "total_params": sum(p.numel() for p in policy.parameters()),
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        # As the adapter and config.json record it (a Hub repo id, a path relative to the current directory): the
        # model card publishes it, so no path of this machine's disk that others cannot use.
        "base_model_path": cfg.policy.pretrained_path if cfg.policy.path is not None else None,
        "peft": None,
    }
    if cfg.policy.path is not None and check_policy_path(cfg.policy.path) is BaseWeights.ADAPTER:
        # An adapter merged into its own base: the weights of each, with their digests (a LeRobot adapter may name
        # its base by an absolute path that nothing pins).
        facts["base_lineage"] = base_lineage(cfg.policy.path)
    if cfg.peft.enabled:
        base_class = type(policy.get_base_model())  # type: ignore[operator]
        facts["peft"] = {
            "method_type": cfg.peft.method_type, "r": cfg.peft.r, "lora_alpha": cfg.peft.alpha(),
            "target_modules": resolve_targets(cfg.peft, base_class),
            "full_training_modules": list(cfg.peft.full_training_modules or []),
        }
    return facts
