"""``policy.path``: the base policy a fine-tuning run starts from, read from a ``pretrained_model/`` directory
written by lerobot_mg or by LeRobot 0.6.1 (its config.json, weights and processors), or a Hub model repo id whose
snapshot huggingface_hub has (or fetches) in its cache.

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
from lerobot_mg.policies.saved_config import build_config, read_saved_policy

# Fields of a base's config that say where the base itself came from or went, not how it is built: the
# fine-tuning run sets its own (its repo, whether it trains an adapter, the base it starts from).
_RUN_OWN_FIELDS = ("path", "repo_id", "push_to_hub", "use_peft", "pretrained_path", "pretrained_revision")
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


def base_features(path: str) -> tuple[dict[str, FeatureSpec], dict[str, FeatureSpec]]:
    """(input_features, output_features) the base was trained with."""
    saved = read_saved_policy(Path(path))
    return saved.input_features, saved.output_features


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
    """``policy.path`` set: the policy group becomes the base's saved config (config.json, a LeRobot one too), with
    this command line's ``policy.*`` overrides on top (e.g. ``policy.dropout=0``), as LeRobot's ``--policy.path``
    does. The path is made absolute (``last`` resolved to its step; a Hub repo id to its cached snapshot), so a resume
    from another directory finds the same base; ``policy.pretrained_path`` records the base as typed."""
    typed_path = str(composed.policy.path)
    revision = OmegaConf.select(composed, "policy.pretrained_revision")
    resolved = resolve_policy_path(typed_path, revision)
    check_policy_path(resolved)
    path = str(Path(resolved).resolve())
    kept = {
        key: OmegaConf.select(composed, key) for key in override_keys(overrides)
        if key.startswith("policy.") and key != "policy.path"
    }
    saved = read_saved_policy(Path(path))
    # The base's values fit its class's types (a wrong one is named here, not deep in OmegaConf); the run's config,
    # with the overrides on top, is validated at start-up.
    build_config(policy_config_class(saved.type), {**saved.values, "type": saved.type}, Path(path) / CONFIG_NAME,
                 validate=False)
    if saved.type != composed.policy.type:  # the base decides the policy: its schema replaces the preset's
        composed.policy = OmegaConf.structured(policy_config_class(saved.type))
    base = {f"policy.{name}": value for name, value in saved.values.items() if name not in _RUN_OWN_FIELDS}
    if saved.values.get("observation_keys") is None:  # a LeRobot base (or ours on every input): what it reads
        base["policy.observation_keys"] = list(saved.input_features)
    run_own = {
        "policy.path": path,
        "policy.pretrained_path": typed_path if resolved != typed_path else path,
        "policy.use_peft": OmegaConf.select(composed, "peft.method_type") is not None,
    }
    for key, value in {**base, **run_own, **kept}.items():
        OmegaConf.update(composed, key, value, merge=False)
    return composed
