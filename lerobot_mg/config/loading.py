"""Composition helpers: the conf/ location, LeRobot-style ``--key=value`` arguments, the typed run config, resume
merging."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError
from omegaconf.nodes import EnumNode

from lerobot_mg.config.choices import choice_error
from lerobot_mg.config.literal import literal_values
from lerobot_mg.config.schema import (
    POLICY_CONFIGS,
    REPO_ROOT,
    SchedulerConfig,
    TrainConfig,
    policy_config_class,
)
from lerobot_mg.errors import ConfigError, config_error

# conf/ is the top-level folder of a checkout (where users edit the presets) and package data in an installed
# wheel (lerobot_mg/conf, mapped from the same folder by pyproject.toml).
_PACKAGED_CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
CONF_DIR = _PACKAGED_CONF_DIR if _PACKAGED_CONF_DIR.is_dir() else REPO_ROOT / "conf"
logger = logging.getLogger(__name__)

# Hydra's own long options; everything else spelled `--a.b=c` is a config override.
_HYDRA_FLAGS = {
    "help", "hydra-help", "version", "cfg", "resolve", "package", "run", "multirun", "shell-completion",
    "config-path", "config-name", "config-dir", "info", "experimental-rerun",
}
_DOTTED_KEY = re.compile(r"^[A-Za-z_][\w.]*$")
_DOTTED_OVERRIDE = re.compile(r"^[+~]*[A-Za-z_][\w.]*=")
# The guide's flat spellings of keys that live in a config group here.
_ALIASES = {"checkpoint_format": "checkpoint.format", "save_freq": "checkpoint.save_freq"}

# A warm-up the user did not type (a preset's, e.g. conf/scheduler/cosine.yaml's 100 steps, written for the default
# 2,000-step run) takes at most this share of the run: a short debug run (steps=8) or a shorter run than the preset
# had in mind scales it down instead of failing, as LeRobot's cosine scheduler scales its warm-up to a short run.
MAX_DEFAULT_WARMUP_SHARE = 0.1


# The RunFacts block of train_config.json (for readers); not part of the schema.
DERIVED_KEY = "run_facts"


def check_presets(overrides: list[str]) -> None:
    """A ``group=option`` override names a preset in conf/<group>/ (Hydra would list them over several lines and
    exit 1; a typo is a user error like any other). A multirun's ``group=a,b`` checks every option."""
    for override in overrides:
        key, equals, value = override.lstrip("+~").partition("=")
        group_dir = CONF_DIR / key
        if not equals or not _DOTTED_KEY.match(key) or not group_dir.is_dir() or value in ("null", ""):
            continue
        existing = sorted(path.stem for path in group_dir.glob("*.yaml"))
        for option in value.split(","):
            if option not in existing:
                raise config_error(key, option, f"is not a preset in conf/{key}/", f"{key}=<one of {', '.join(existing)}>")


def choice_error_of(error: BaseException, key: str | None = None) -> ConfigError | None:
    """The one-line user error for OmegaConf's refusal of a word that is none of an Enum field's members (raised
    as it is, or as the cause of Hydra's composition error), naming ``key`` (default: the error's full key), the
    allowed words and the fix; None for any other error."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ValidationError):
        cause = cause.__cause__
    if cause is None or not isinstance(getattr(cause, "child_node", None), EnumNode):
        return None
    return choice_error(key or cause.full_key, cause.value, cause.child_node.enum_type)


def check_choices(overrides: list[str]) -> None:
    """A ``key=value`` override of a field typed by an Enum (``checkpoint.format``, ``policy.feedforward_activation``,
    ...) names one of its members; each value of a multirun's ``key=a,b`` too. Checked against the schemas before
    Hydra composes, which would print the refusal over several lines and exit 1. A ``policy.*`` key is checked
    against every policy config that has it."""
    train_schema = OmegaConf.structured(TrainConfig)
    parser = OverridesParser.create()
    for typed in overrides:
        if not _DOTTED_OVERRIDE.match(typed):
            continue
        try:
            (override,) = parser.parse_overrides([typed])
        except HydraException:  # a syntax error: Hydra reports it while composing
            continue
        if override.is_delete() or override.is_hydra_override():
            continue
        if override.is_sweep_override():  # a choice of words; a glob of presets or a range is no Enum field
            if not isinstance(override.value(), ChoiceSweep):
                continue
            values: list[Any] = list(override.sweep_string_iterator())
        else:
            values = [override.value()]
        key = override.key_or_group
        if key.startswith("policy."):
            schemas = [(OmegaConf.structured(config), key.removeprefix("policy.")) for config in POLICY_CONFIGS.values()]
        else:
            schemas = [(train_schema, key)]
        for schema, schema_key in schemas:
            for value in values:
                try:
                    OmegaConf.update(schema, schema_key, value, merge=True)
                except OmegaConfBaseException as error:  # anything but a choice: Hydra reports it while composing
                    translated = choice_error_of(error, key)
                    if translated is not None:
                        raise translated from None


def normalize_argv(argv: list[str]) -> list[str]:
    """Accept LeRobot's ``--steps=100`` / ``--parallelism.dp_shard=4`` spelling as Hydra overrides."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            key = _ALIASES.get(key, key)
            if key not in _HYDRA_FLAGS and _DOTTED_KEY.match(key):
                out.append(f"{key}={value}")
                continue
        out.append(arg)
    return out


def schema_for(config: dict[str, Any] | DictConfig) -> DictConfig:
    """TrainConfig's structured schema with ``policy`` typed by the config class of ``config``'s policy type."""
    schema = OmegaConf.structured(TrainConfig)
    policy_type = OmegaConf.select(OmegaConf.create(config), "policy.type", default=None)
    if policy_type is not None:
        schema.policy = OmegaConf.structured(policy_config_class(str(policy_type)))
    return schema


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The typed object of a composed (or loaded) config; raises on unknown keys or wrong types."""
    # Merge a plain container: a `+key=value` override opens the struct flag of the composed node, and merging
    # the node itself would let an unknown (typo) key through.
    container = OmegaConf.to_container(cfg, resolve=False)
    merged = OmegaConf.merge(schema_for(container), container)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def run_config(composed: DictConfig, typed_keys: frozenset[str]) -> TrainConfig:
    """The typed config a launch runs. ``typed_keys``: the dotted keys this command line set (``override_keys``);
    a default the user did not type never stops a run, so a preset's warm-up is fitted to ``steps`` (a resumed run
    keeps the schedule its train_config.json saved)."""
    cfg = to_train_config(composed)
    typed = cfg.resume or "scheduler.num_warmup_steps" in typed_keys
    cfg.scheduler = fit_warmup(cfg.scheduler, cfg.steps, typed)
    cfg.dataset = cfg.dataset.from_repo(root_typed="dataset.root" in typed_keys)
    return cfg


def fit_warmup(cfg: SchedulerConfig, steps: int, typed: bool) -> SchedulerConfig:
    """``cfg`` with a warm-up the user did not type scaled down to ``MAX_DEFAULT_WARMUP_SHARE`` of ``steps``
    where it is longer (and the change logged); a typed warm-up is kept as typed (validation refuses one that
    does not fit)."""
    fitted = int(steps * MAX_DEFAULT_WARMUP_SHARE)
    if typed or cfg.type == "none" or cfg.num_warmup_steps <= fitted:
        return cfg
    if os.environ.get("RANK", "0") == "0":
        logger.info(
            "scheduler.num_warmup_steps=%d (not typed: the preset's) is more than %d%% of steps=%d: scaled down to "
            "%d warm-up steps. Type scheduler.num_warmup_steps=<N> to choose it yourself.",
            cfg.num_warmup_steps, round(100 * MAX_DEFAULT_WARMUP_SHARE), steps, fitted,
        )
    return replace(cfg, num_warmup_steps=fitted)


def train_config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The typed config as plain values, for train_config.json, the trackers and the model card. Not resolved:
    the typed object's interpolations were resolved when it was built, so a string in it that reads like one
    (``${oc.env:...}`` from a resumed file, see :func:`literal_values`) is data and is written as it is."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=False)  # type: ignore[return-value]


def load_train_config_json(path: Path) -> DictConfig:
    """A saved train_config.json as a config whose strings are the file's literal text (:func:`literal_values`):
    nothing in a file from someone else is resolved against this machine's environment or this run's config."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"config_path={str(path)!r}: is not valid JSON ({error}), the save was interrupted. Fix: "
                          "config_path=<the train_config.json of an earlier checkpoint>") from error
    if not isinstance(data, dict):
        raise ConfigError(f"config_path={str(path)!r}: holds a JSON {type(data).__name__}, not a train config. Fix: "
                          "config_path=<the train_config.json of an earlier checkpoint>")
    data.pop(DERIVED_KEY, None)
    return OmegaConf.create(literal_values(data, path))


def override_keys(overrides: list[str]) -> list[str]:
    """Dotted keys (or group names) that command-line overrides set, e.g. ``parallelism.dp_shard=2``."""
    keys = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra.") or key == "hydra":
            continue
        keys.append(key)
    return keys


def check_resume_request(resume: bool, config_path: str | None) -> None:
    """The resume inputs alone, before the saved config is read: resume=true names a train_config.json that exists,
    and only a resume names one."""
    if resume:
        if config_path is None:
            raise config_error(
                "config_path", None, "resume=true needs the train_config.json of the checkpoint to resume",
                "config_path=<run>/checkpoints/last/pretrained_model/train_config.json",
            )
        if not Path(config_path).is_file():
            raise config_error(
                "config_path", config_path,
                "is a directory, not the train_config.json file in it" if Path(config_path).is_dir()
                else "does not exist",
                "config_path=<run>/checkpoints/last/pretrained_model/train_config.json",
            )
    elif config_path is not None:
        raise config_error("config_path", config_path, "is only read when resuming", "resume=true, or remove config_path")


def merge_resume_config(composed: DictConfig, overrides: list[str]) -> DictConfig:
    """The config of a resumed run: the saved ``train_config.json``, with this launch's overrides on top.

    Only keys the user overrode on this command line are taken from the freshly composed config (a new
    ``parallelism.dp_shard``, more ``steps``, ...); everything else is what the original run used.
    """
    check_resume_request(bool(composed.resume), composed.config_path)
    saved = load_train_config_json(Path(composed.config_path))
    try:
        merged = OmegaConf.merge(schema_for(saved), saved)
    except OmegaConfBaseException as error:
        raise ConfigError(
            f"config_path={composed.config_path!r}: does not match this version's config schema ({error}). Fix: "
            "resume with the lerobot_mg version that wrote it, or start a new run"
        ) from error
    if "training_recipe" not in saved:  # written before policy presets: keep the defaults that run trained with
        merged.use_policy_training_preset = False
    saved_type = merged.policy.type
    if composed.policy.type != saved_type and {"policy", "policy.type"} & set(override_keys(overrides)):
        raise config_error(
            "policy", composed.policy.type,
            f"config_path holds a {saved_type!r} policy; a resume continues the same policy",
            f"remove the policy override, or fine-tune a new run from it: resume=false "
            f"policy.path=<the checkpoint's pretrained_model> policy={saved_type}",
        )
    for key in override_keys(overrides):
        if key == "experiment":
            raise ConfigError(
                "experiment=...: an experiment preset cannot be applied on resume (the saved train_config.json "
                "already fixes the run). Fix: override the individual keys instead"
            )
        OmegaConf.update(merged, key, OmegaConf.select(composed, key), merge=False)
    merged.resume = True
    merged.config_path = composed.config_path
    return merged
