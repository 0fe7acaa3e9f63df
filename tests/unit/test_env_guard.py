"""The accelerate environment guard: launcher defaults pass, configuration variables are refused."""

from __future__ import annotations

import logging

import pytest

from lerobot_mg.distributed.env_guard import ALLOW_ENV_VAR, check_accelerate_env, find_accelerate_overrides
from lerobot_mg.errors import ConfigError

# Exactly what `accelerate launch --num_processes=2 train.py` (accelerate 1.15, no config file) exports,
# captured from a real launch; `--multi_gpu` omits ACCELERATE_USE_CPU.
PLAIN_LAUNCH_ENV = {
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_DYNAMO_MODE": "default",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_USE_CPU": "False",
}
# Variables any process has, which the guard must not look at.
UNRELATED_ENV = {"PATH": "/usr/bin", "RANK": "0", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "HOME": "/root"}


def test_plain_accelerate_launch_defaults_are_not_overrides() -> None:
    assert find_accelerate_overrides({**UNRELATED_ENV, **PLAIN_LAUNCH_ENV}) == {}
    check_accelerate_env({**UNRELATED_ENV, **PLAIN_LAUNCH_ENV})  # does not raise


def test_logging_variables_are_harmless() -> None:
    env = {**PLAIN_LAUNCH_ENV, "ACCELERATE_LOG_LEVEL": "debug", "ACCELERATE_DEBUG_MODE": "1"}
    assert find_accelerate_overrides(env) == {}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        # A launcher flag that changes a default is configuration too.
        ("ACCELERATE_MIXED_PRECISION", "bf16"),
        ("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR"),
        ("ACCELERATE_USE_CPU", "true"),
        # What an accelerate config file (or `accelerate config`) adds.
        ("ACCELERATE_USE_FSDP", "true"),
        ("ACCELERATE_USE_PARALLELISM_CONFIG", "true"),
        ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4"),
        ("FSDP_SHARDING_STRATEGY", "FULL_SHARD"),
        ("FSDP_VERSION", "2"),
        ("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2"),
        ("ACCELERATE_USE_DEEPSPEED", "true"),
        ("DEEPSPEED_CONFIG_FILE", "ds.json"),
        ("MEGATRON_LM_TP_DEGREE", "2"),
    ],
)
def test_configuration_variables_are_overrides(name: str, value: str) -> None:
    env = {**UNRELATED_ENV, **PLAIN_LAUNCH_ENV, name: value}
    assert find_accelerate_overrides(env) == {name: value}


def test_defaults_are_compared_case_insensitively() -> None:
    env = {"ACCELERATE_MIXED_PRECISION": " NO ", "ACCELERATE_USE_CPU": "false", "ACCELERATE_DYNAMO_BACKEND": "no"}
    assert find_accelerate_overrides(env) == {}


def test_refusal_lists_every_variable_and_both_remedies() -> None:
    env = {**PLAIN_LAUNCH_ENV, "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "ACCELERATE_USE_FSDP": "true"}
    with pytest.raises(ConfigError) as info:
        check_accelerate_env(env)
    message = str(info.value)
    # One line: sorted, with the value the run would have used.
    assert "\n" not in message
    assert message.startswith("ACCELERATE_USE_FSDP=true FSDP_SHARDING_STRATEGY=FULL_SHARD: accelerate configuration")
    assert "ACCELERATE_MIXED_PRECISION" not in message
    assert "parallelism.* / accelerator.* overrides" in message  # remedy 1: our own config
    assert "accelerate launch --num_processes=N` without a config file" in message
    assert f"set {ALLOW_ENV_VAR}=1" in message  # remedy 2: acknowledge


@pytest.mark.parametrize("allow", ["1", "true", "YES"])
def test_acknowledged_overrides_proceed_with_a_warning(allow: str, caplog: pytest.LogCaptureFixture) -> None:
    env = {"FSDP_SHARDING_STRATEGY": "FULL_SHARD", ALLOW_ENV_VAR: allow}
    with caplog.at_level(logging.WARNING, logger="lerobot_mg.distributed.env_guard"):
        check_accelerate_env(env)
    assert f"{ALLOW_ENV_VAR}=1: proceeding" in caplog.text
    assert "FSDP_SHARDING_STRATEGY=FULL_SHARD" in caplog.text


@pytest.mark.parametrize("allow", ["0", "", "false"])
def test_anything_but_an_explicit_yes_still_refuses(allow: str) -> None:
    with pytest.raises(ConfigError, match="FSDP_SHARDING_STRATEGY=FULL_SHARD"):
        check_accelerate_env({"FSDP_SHARDING_STRATEGY": "FULL_SHARD", ALLOW_ENV_VAR: allow})


def test_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV_VAR, raising=False)
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "4")
    with pytest.raises(ConfigError, match="PARALLELISM_CONFIG_DP_SHARD_SIZE=4"):
        check_accelerate_env()
