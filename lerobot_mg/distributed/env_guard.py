"""Refuse accelerate's environment-variable configuration before anything distributed starts.

Accelerate's YAML configs (``accelerate launch --config_file``, ``accelerate config``) configure the engine
through environment variables that bypass our config system, so ``train_config.json`` would no longer describe
the run. A plain ``accelerate launch --num_processes=N`` still exports a handful of ``ACCELERATE_*`` variables
at their default values: those are judged by value and let through.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from lerobot_mg.errors import ConfigError

logger = logging.getLogger(__name__)

ALLOW_ENV_VAR = "LEROBOT_ALLOW_ACCELERATE_ENV"

# What `accelerate launch` with no config file exports (accelerate 1.15), with the values it uses.
# Compared case-insensitively.
_LAUNCHER_DEFAULTS: dict[str, set[str]] = {
    "ACCELERATE_DYNAMO_BACKEND": {"no"},
    "ACCELERATE_DYNAMO_MODE": {"default"},
    "ACCELERATE_DYNAMO_USE_DYNAMIC": {"false"},
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": {"false"},
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": {"false"},
    "ACCELERATE_MIXED_PRECISION": {"no"},
    "ACCELERATE_USE_CPU": {"false"},
}
# Variables that carry no engine configuration (logging, launcher bookkeeping).
_HARMLESS = {"ACCELERATE_LOG_LEVEL", "ACCELERATE_DEBUG_MODE", "ACCELERATE_CONFIG_DS_FIELDS_PRINTED"}
_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "DEEPSPEED_", "MEGATRON_LM_")


def find_accelerate_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that would configure accelerate behind our config's back."""
    offending = {}
    for name, value in environ.items():
        if not name.startswith(_PREFIXES) or name in _HARMLESS:
            continue
        allowed = _LAUNCHER_DEFAULTS.get(name)
        if allowed is not None and value.strip().lower() in allowed:
            continue
        offending[name] = value
    return dict(sorted(offending.items()))


def check_accelerate_env(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` listing accelerate config variables, unless acknowledged.

    Runs once, before the Accelerator exists (the Accelerator itself writes ``ACCELERATE_USE_FSDP``).
    """
    environ = os.environ if environ is None else environ
    offending = find_accelerate_overrides(environ)
    if not offending:
        return
    listing = "\n".join(f"  {name}={value}" for name, value in offending.items())
    if environ.get(ALLOW_ENV_VAR, "").strip().lower() in ("1", "true", "yes"):
        logger.warning(
            "%s=1: proceeding although accelerate environment variables are set; train_config.json may not "
            "describe the settings this run actually uses:\n%s", ALLOW_ENV_VAR, listing,
        )
        return
    # One line, like every user error: the variables with their values, where they come from, the remedies.
    raise ConfigError(
        f"{' '.join(f'{name}={value}' for name, value in offending.items())}: accelerate configuration in the "
        "environment (an exported variable, `accelerate launch --config_file`, or accelerate's default config "
        "$HF_HOME/accelerate/default_config.yaml) would configure accelerate behind lerobot_mg's config. Fix: put "
        "these settings in parallelism.* / accelerator.* overrides (e.g. parallelism.dp_shard=-1 "
        "accelerator.mixed_precision=bf16) and launch with `accelerate launch --num_processes=N` without a config "
        f"file (or torchrun), or set {ALLOW_ENV_VAR}=1 to acknowledge the override and proceed anyway"
    )
