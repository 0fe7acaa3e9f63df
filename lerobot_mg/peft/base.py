"""``policy.path``: the base policy a fine-tuning run starts from, read from a ``pretrained_model/`` directory.

Three kinds of directory hold a loadable base: our own checkpoints and gathered safetensors
(``model.safetensors``), converted DCP checkpoints (the same file, written by ``lerobot-mg-convert-dcp``), and
PEFT runs (``adapter_model.safetensors``: the adapter is merged into its own base first). A directory holding
DCP shards only cannot be read without a process group of the saved topology, so it is refused before any
process group exists, with the command that converts it.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.loading import override_keys
from lerobot_mg.config.policy import is_repo_id
from lerobot_mg.config.schema import policy_config_class
from lerobot_mg.data.hub import resolve_policy_path
from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.policies.base import CONFIG_NAME, FeatureSpec, features_from_dataset

# config.json keys that describe the saved policy's data rather than its hyper-parameters.
_FEATURE_KEYS = ("input_features", "output_features")
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class BaseWeights(enum.Enum):
    FULL = "model.safetensors"
    ADAPTER = "adapter_model.safetensors (merged into its own base)"


def check_policy_path(path: str) -> BaseWeights:
    """Which weights ``policy.path`` holds; raises the user error naming the fix when it holds none."""
    directory = Path(path)
    fix = "policy.path=<run>/checkpoints/<step or last>/pretrained_model"
    if not directory.is_dir():
        raise config_error("policy.path", path, "is not a directory", fix)
    if not (directory / CONFIG_NAME).is_file():
        raise config_error("policy.path", path, f"holds no {CONFIG_NAME}: it is not a pretrained_model directory", fix)
    if (directory / L.MODEL_SAFETENSORS).is_file():
        return BaseWeights.FULL
    if (directory / L.ADAPTER_SAFETENSORS).is_file() and (directory / L.ADAPTER_CONFIG_JSON).is_file():
        return BaseWeights.ADAPTER
    if (directory / L.MODEL_DCP_DIR).is_dir():
        raise config_error(
            "policy.path", path,
            f"holds DCP shards only ({L.MODEL_DCP_DIR}/, a checkpoint.format=dcp checkpoint), which load only "
            "after conversion",
            f"lerobot-mg-convert-dcp checkpoint_dir={path}, then rerun with the same policy.path",
        )
    raise config_error(
        "policy.path", path, f"holds neither {L.MODEL_SAFETENSORS} nor {L.ADAPTER_SAFETENSORS}: no weights", fix
    )


def read_policy_config(path: str) -> dict[str, Any]:
    """The policy group's values saved in ``path``/config.json (hyper-parameters only, no features)."""
    raw = json.loads((Path(path) / CONFIG_NAME).read_text())
    return {key: value for key, value in raw.items() if key not in _FEATURE_KEYS}


def base_features(path: str) -> tuple[dict[str, FeatureSpec], dict[str, FeatureSpec]]:
    """(input_features, output_features) the base was trained with."""
    raw = json.loads((Path(path) / CONFIG_NAME).read_text())
    return raw["input_features"], raw["output_features"]


def adapter_base_path(adapter_dir: Path) -> str:
    """The base directory of the adapter in ``adapter_dir``: adapter_config.json's ``base_model_name_or_path``, a
    directory (ours are absolute), else a relative one as LeRobot writes it (the ``--policy.path`` typed, relative to
    the directory training ran in): looked up from the current directory (where PEFT looks), then from each folder
    above the adapter, else a Hub model repo id resolved through huggingface_hub's cache."""
    recorded = json.loads((Path(adapter_dir) / L.ADAPTER_CONFIG_JSON).read_text()).get("base_model_name_or_path")
    if not recorded:
        raise ConfigError(f"{Path(adapter_dir) / L.ADAPTER_CONFIG_JSON}: records no base_model_name_or_path. Fix: "
                          "set it to the base's pretrained_model directory")
    candidates = [Path(recorded), *(folder / recorded for folder in Path(adapter_dir).resolve().parents)]
    found = next((path for path in candidates if path.is_dir()), None)
    if found is not None:
        return str(found.resolve())
    if is_repo_id(recorded):
        return resolve_policy_path(recorded)
    raise ConfigError(
        f"{Path(adapter_dir) / L.ADAPTER_CONFIG_JSON} names the base model {recorded}, which is not a directory "
        f"here, nor under any folder above the adapter. Fix: restore the base checkpoint there, or set "
        "base_model_name_or_path to where it now lives"
    )


def stored_dtype(path: str) -> torch.dtype:
    """The floating dtype the base's weights are stored in (read from the file header, no tensor loaded)."""
    directory = Path(path)
    if not (directory / L.MODEL_SAFETENSORS).is_file():  # an adapter: the precision of its own base
        return stored_dtype(adapter_base_path(directory))
    with safe_open(str(directory / L.MODEL_SAFETENSORS), framework="pt") as weights:
        stored = {weights.get_slice(key).get_dtype() for key in weights.keys()}  # noqa: SIM118 (not a dict)
    floating = [_SAFETENSORS_DTYPES[name] for name in stored if name in _SAFETENSORS_DTYPES]
    return floating[0] if len(floating) == 1 else torch.float32


def check_dataset_matches(path: str, dataset_features: dict[str, dict[str, Any]]) -> None:
    """The dataset provides every input the base reads, with the shapes it was trained on."""
    inputs, outputs = base_features(path)
    dataset_inputs, dataset_outputs = features_from_dataset(dataset_features, sorted(inputs))
    for name, (want, have) in {**{k: (inputs[k], dataset_inputs[k]) for k in inputs},
                               "action": (outputs["action"], dataset_outputs["action"])}.items():
        if list(want["shape"]) != list(have["shape"]):
            raise ConfigError(
                f"policy.path={path}: the base reads {name} of shape {want['shape']}, the dataset has "
                f"{have['shape']}. Fix: a dataset with the base's features, or another policy.path"
            )


def apply_policy_path(composed: DictConfig, overrides: list[str]) -> DictConfig:
    """``policy.path`` set: the policy group becomes the base's saved config (config.json), with this command
    line's ``policy.*`` overrides on top (e.g. ``policy.dropout=0``), as LeRobot's ``--policy.path`` does. The path
    is made absolute (``last`` resolved to its step), so a resume from another directory finds the same base."""
    composed.policy.path = resolve_policy_path(str(composed.policy.path))  # a Hub repo id: its cached snapshot
    check_policy_path(str(composed.policy.path))
    path = str(Path(composed.policy.path).resolve())
    kept = {
        key: OmegaConf.select(composed, key) for key in override_keys(overrides)
        if key.startswith("policy.") and key != "policy.path"
    }
    saved = read_policy_config(path)
    if saved["type"] != composed.policy.type:  # the base decides the policy: its schema replaces the preset's
        composed.policy = OmegaConf.structured(policy_config_class(str(saved["type"])))
    # Where the base was published is not where its fine-tune goes: policy.repo_id / push_to_hub are this run's.
    base = {f"policy.{name}": value for name, value in saved.items() if name not in ("repo_id", "push_to_hub")}
    for key, value in {**base, "policy.path": path, **kept}.items():
        OmegaConf.update(composed, key, value, merge=False)
    return composed
