"""A pretrained_model/'s config.json as LeRobot 0.6.1 writes and reads it, and the lerobot_mg-only fields beside it.

config.json holds LeRobot's fields for the policy type and nothing else, ``type`` first, encoded as draccus encodes
them (``json.dumps(..., indent=4)``), so LeRobot's ``from_pretrained`` reads a checkpoint of ours. The fields only
lerobot_mg has (``PolicyConfig.lerobot_mg_only_fields``) live in the run's train_config.json, which our
pretrained_model/ holds too, and are read back from its ``policy`` section. A LeRobot checkpoint reads the same way:
its fields we do not act on (``device``, ``use_amp``) are kept, ours take their defaults.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypedDict

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lerobot_mg.checkpoint.layout import TRAIN_CONFIG_JSON
from lerobot_mg.config.choices import FeatureType
from lerobot_mg.config.literal import literal_values
from lerobot_mg.config.policy import PolicyConfig
from lerobot_mg.config.schema import POLICY_CONFIGS, policy_config_class
from lerobot_mg.errors import ConfigError, config_error

CONFIG_NAME = "config.json"
FEATURE_KEYS = ("input_features", "output_features")


class FeatureSpec(TypedDict):
    type: str
    shape: list[int]


def encode_config_value(value: Any) -> Any:
    """A config value as draccus encodes it into LeRobot's config.json: enums as their values, paths as strings,
    tuples as lists, containers recursively."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(encode_config_value(key)): encode_config_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [encode_config_value(item) for item in value]
    return value


def lerobot_config_dict(config: PolicyConfig, input_features: dict[str, FeatureSpec],
                        output_features: dict[str, FeatureSpec]) -> dict[str, Any]:
    """config.json as LeRobot 0.6.1 writes it: ``type`` first, then every field of the config that LeRobot has
    (all but ``lerobot_mg_only_fields``) with the features after ``n_obs_steps``, as LeRobot orders them; a policy
    without a camera writes its ``camera_only_fields`` with LeRobot's values."""
    values = {
        item.name: encode_config_value(getattr(config, item.name)) for item in fields(config)
        if item.name != "type" and item.name not in config.lerobot_mg_only_fields
    }
    if not any(spec["type"] == FeatureType.VISUAL.value for spec in input_features.values()):
        values.update(config.camera_only_fields)
    head = {"type": config.type, "n_obs_steps": values.pop("n_obs_steps"),
            "input_features": input_features, "output_features": output_features}
    return {**head, **values}


@dataclass(frozen=True)
class SavedPolicy:
    """What a pretrained_model/ directory says about its policy: the type, the config fields (config.json's, and
    the lerobot_mg-only ones from train_config.json's ``policy`` section when it has one) and the features."""

    type: str
    values: dict[str, Any]
    input_features: dict[str, FeatureSpec]
    output_features: dict[str, FeatureSpec]


def _coerce_to_field_types(config_class: type[PolicyConfig], values: dict[str, Any]) -> dict[str, Any]:
    """JSON booleans and integers swapped where the field is typed the other way (LeRobot writes an int field whose
    default is ``False`` as ``false`` from Python and as ``0`` once draccus has read and saved it again)."""
    hints = typing.get_type_hints(config_class)
    coerced = dict(values)
    for name, value in values.items():
        hint = hints[name]
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        allowed = set(typing.get_args(hint)) if is_union else {hint}
        if isinstance(value, bool) and int in allowed and bool not in allowed:
            coerced[name] = int(value)
        elif type(value) is int and value in (0, 1) and bool in allowed and int not in allowed:
            coerced[name] = bool(value)
    return coerced


def read_saved_policy(directory: Path, key: str = "policy.path") -> SavedPolicy:
    """Read ``directory``'s config.json (LeRobot's or ours) and the lerobot_mg-only fields of its train_config.json.

    A field config.json lacks takes its default, as in LeRobot; a field the policy config does not have is refused
    with a ConfigError, as LeRobot refuses it. The lerobot_mg-only fields come from train_config.json (our own
    checkpoints); a LeRobot checkpoint has none, so they take their defaults."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    fix = "a pretrained_model directory written by lerobot_mg or LeRobot 0.6.1"
    if not config_path.is_file():
        raise config_error(key, str(directory), f"holds no {CONFIG_NAME}: it is not a pretrained_model directory",
                           f"{key}=<run>/checkpoints/<step or last>/pretrained_model")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{config_path}: is not valid JSON ({error}). Fix: {fix}") from error
    if not isinstance(raw, dict) or "type" not in raw:
        raise ConfigError(f"{config_path}: has no 'type' field, so the policy it holds is unknown. Fix: {fix}")
    policy_type = raw.pop("type")
    # A base of another type (LeRobot's pi0, smolvla, ...) is named as such, not as a mistyped policy.type.
    if not isinstance(policy_type, str) or policy_type not in POLICY_CONFIGS:
        raise config_error(key, str(directory), f"its {CONFIG_NAME} names the policy type {policy_type!r}, which "
                           f"lerobot_mg does not build (it builds {', '.join(POLICY_CONFIGS)})",
                           f"{key}=<a pretrained_model directory of one of those types>")
    config_class = policy_config_class(policy_type)
    missing_features = [name for name in FEATURE_KEYS if name not in raw]
    if missing_features:
        raise ConfigError(f"{config_path}: has no {missing_features}, the policy's inputs and outputs. Fix: {fix}")
    features = {name: raw.pop(name) for name in FEATURE_KEYS}
    known = {item.name for item in fields(config_class)} - {"type"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{config_path}: has fields {unknown} that {config_class.__name__} lacks (written by "
                          f"another version of the policy). Fix: {fix}, or remove them from its {CONFIG_NAME}")
    train_config_path = directory / TRAIN_CONFIG_JSON
    saved_policy = {}
    if train_config_path.is_file():
        try:
            saved_policy = json.loads(train_config_path.read_text()).get("policy") or {}
        except json.JSONDecodeError as error:
            raise ConfigError(f"{train_config_path}: is not valid JSON ({error}). Fix: {fix}") from error
    # The lerobot_mg-only fields, and the camera-only ones, which config.json gives LeRobot's value where the
    # policy has no camera (see lerobot_config_dict): the run's own record of them wins.
    recorded = {*config_class.lerobot_mg_only_fields, *config_class.camera_only_fields}
    ours = {name: saved_policy[name] for name in sorted(recorded) if name in saved_policy}
    values = _coerce_to_field_types(config_class, {**raw, **ours})
    return SavedPolicy(policy_type, values, features["input_features"], features["output_features"])


def build_config(config_class: type[PolicyConfig], values: dict[str, Any], source: Path,
                 validate: bool = True) -> PolicyConfig:
    """The config dataclass of ``values`` through its schema (each value converted to the field's type, e.g. an
    enum from its word), validated unless ``validate`` is false; a value of the wrong type is a ConfigError naming
    the field and ``source``. Strings are literal text: a ``${...}`` in a saved file is never resolved."""
    merged = OmegaConf.structured(config_class)
    try:
        for name, value in values.items():  # replaced, not merged: a saved mapping drops the default's other keys
            OmegaConf.update(merged, name, literal_values(value, source, f"policy.{name}"), merge=False)
    except OmegaConfBaseException as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(f"{source}: policy.{getattr(error, 'full_key', '?')} does not fit "
                          f"{config_class.__name__} ({reason}). Fix: a pretrained_model directory written by "
                          "lerobot_mg or LeRobot 0.6.1") from error
    config = OmegaConf.to_object(merged)
    if validate:
        config.validate()  # type: ignore[union-attr]
    return config  # type: ignore[return-value]
