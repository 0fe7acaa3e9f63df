"""The Hydra config tree and every user-facing config check.

Every preset in conf/ composes into the typed ``TrainConfig`` and validates; typos and wrong types fail at
compose time; LeRobot's ``--key=value`` spelling works; every ``ValueError`` of
:mod:`lerobot_mg.config.validate` names the dotted key, the bad value and the override that fixes it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

from lerobot_mg.config import register_configs
from lerobot_mg.config.loading import CONF_DIR, normalize_argv, to_train_config
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.config.validate import validate
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from tests.launch_utils import PUSHT_SLICE

# A valid run: the debug experiment on the real PushT slice.
VALID = ["experiment=pusht_debug", f"dataset.root={PUSHT_SLICE}"]
SHARDED = [*VALID, "parallelism.dp_shard=2"]  # validated for 2 processes


def _compose(overrides: list[str], config_dir: Path = CONF_DIR) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _train_config(overrides: list[str]) -> TrainConfig:
    return to_train_config(_compose(overrides))


def _validation_error(overrides: list[str], world_size: int = 1) -> str:
    cfg = _train_config(overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size)
    return str(error.value)


def _assert_subset(expected: Any, actual: Any, path: str = "") -> None:
    """Every key of ``expected`` is in ``actual`` with the same value (``actual`` may hold more keys)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        for key, value in expected.items():
            assert key in actual, f"{path}.{key} missing"
            _assert_subset(value, actual[key], f"{path}.{key}")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# --- every preset composes, types and validates -------------------------------------------------------------

PRESETS = [
    (group.name, option.stem)
    for group in sorted(CONF_DIR.iterdir())
    if group.is_dir() and group.name != "hydra"  # hydra/ holds launcher plugins, not TrainConfig groups
    for option in sorted(group.glob("*.yaml"))
]
# (world size, extra overrides) under which a preset is a valid run on its own.
LAUNCH_FOR = {
    ("parallelism", "fsdp"): (2, []),
    ("parallelism", "hsdp"): (4, []),
    ("checkpoint", "dcp"): (2, ["parallelism=fsdp"]),
    ("checkpoint", "safetensors_dcp"): (2, ["parallelism=fsdp"]),
}


def test_presets_cover_every_group() -> None:
    groups = {group for group, _ in PRESETS}
    assert {
        "parallelism",
        "accelerator",
        "policy",
        "peft",
        "checkpoint",
        "dataset",
        "optimizer",
        "scheduler",
        "logging",
        "experiment",
    } <= groups
    assert len(PRESETS) >= 20


@pytest.mark.parametrize(("group", "option"), PRESETS, ids=[f"{g}={o}" for g, o in PRESETS])
def test_every_preset_composes_into_the_schema_and_validates(group: str, option: str, tmp_path: Path) -> None:
    world_size, extra = LAUNCH_FOR.get((group, option), (1, []))
    if (group, option) == ("peft", "lora"):  # LoRA fine-tunes a base: give it a (tiny) one
        policy = ACTPolicy(ACTConfig(chunk_size=10, n_action_steps=10, dim_model=16, n_heads=2, dim_feedforward=32),
                           {"observation.state": {"type": "STATE", "shape": [2]}},
                           {"action": {"type": "ACTION", "shape": [2]}})
        policy.save_pretrained(tmp_path / "pretrained_model")
        extra = [*extra, f"policy.path={tmp_path / 'pretrained_model'}"]
    # The dataset root is replaced by the PushT slice so that the validation below finds a real dataset.
    composed = _compose([f"{group}={option}", *extra, f"dataset.root={PUSHT_SLICE}"])
    preset = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"), resolve=True)
    defaults = preset.pop("defaults", [])
    actual = OmegaConf.to_container(composed, resolve=True)
    if group == "experiment":  # `# @package _global_`: deltas on the whole config
        preset.get("dataset", {}).pop("root", None)  # replaced above
        for override in defaults:  # e.g. {"override /dataset": "embedded"}
            ((key, value),) = override.items()
            assert actual[key.removeprefix("override /")]["name" if "dataset" in key else "type"] == value
        _assert_subset(preset, actual)
    else:
        if group == "dataset":
            preset.pop("root")
        _assert_subset(preset, actual[group], group)

    cfg = to_train_config(composed)
    assert isinstance(cfg, TrainConfig)
    validate(cfg, world_size)


def test_defaults_are_the_offline_single_process_run() -> None:
    cfg = _train_config([f"dataset.root={PUSHT_SLICE}"])
    assert (cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard) == (1, 1)
    assert cfg.accelerator.mixed_precision == "no"
    assert (cfg.checkpoint.format, cfg.dataset.name, cfg.scheduler.type) == (
        "safetensors",
        "embedded",
        "cosine",
    )
    assert cfg.logging.wandb.mode == "offline"


def test_command_line_wins_over_the_experiment() -> None:
    cfg = _train_config([*VALID, "steps=7", "scheduler=cosine", "scheduler.num_warmup_steps=2"])
    assert (cfg.job_name, cfg.steps, cfg.scheduler.type, cfg.scheduler.num_warmup_steps) == (
        "pusht_debug",
        7,
        "cosine",
        2,
    )


def test_override_values_keep_their_types() -> None:
    cfg = _train_config(
        [
            *VALID,
            "accelerator.mixed_precision=no",
            "parallelism.dp_shard=-1",
            "accelerator.fsdp.wrap_modules=[ACTEncoderLayer]",
            "accelerator.fsdp.ignored_modules=model\\.encoder.*",
            "accelerator.fsdp.mixed_precision_policy.param_dtype=bfloat16",
        ]
    )
    assert cfg.accelerator.mixed_precision == "no"  # a string, not YAML's boolean false
    assert cfg.parallelism.dp_shard == -1
    assert cfg.accelerator.fsdp.wrap_modules == ["ACTEncoderLayer"]
    assert cfg.accelerator.fsdp.ignored_modules == "model\\.encoder.*"
    assert cfg.accelerator.fsdp.mixed_precision_policy.param_dtype == "bfloat16"


# --- typos and wrong types fail at compose time -------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "cause"),
    [
        ("parallelism.dp_shrad=2", "Key 'dp_shrad' not in 'ParallelismConfig'"),
        ("accelerator.fsdp.wrap_module=[Block]", "Key 'wrap_module' not in 'FSDPConfig'"),
        ("steps=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
        (
            "accelerator.fsdp.min_num_params=1e6",
            "Value '1000000.0' of type 'float' could not be converted to Integer",
        ),
        ("accelerator.fsdp.reshard_after_forward=maybe", "Value 'maybe' is not a valid bool"),
    ],
)
def test_typos_and_wrong_types_fail_at_compose_time(override: str, cause: str) -> None:
    with pytest.raises(ConfigCompositionException) as error:
        _compose([*VALID, override])
    key = override.lstrip("+").split("=")[0]
    assert key in str(error.value)
    assert cause in str(error.value.__cause__)


def test_appended_typo_fails_when_typed() -> None:
    """Hydra's error suggests ``+key=value`` for an unknown key; ``+`` opens the struct, so that spelling
    composes, and the typed conversion every entry point does next refuses it."""
    composed = _compose([*VALID, "+parallelism.dp_shrad=2"])
    with pytest.raises(ConfigKeyError, match="Key 'dp_shrad' not in 'ParallelismConfig'"):
        to_train_config(composed)


def test_unknown_preset_lists_the_available_ones() -> None:
    with pytest.raises(MissingConfigException) as error:
        _compose(["parallelism=fdsp"])
    assert "Could not find 'parallelism/fdsp'" in str(error.value)
    assert "ddp" in str(error.value) and "hsdp" in str(error.value)


def test_typo_inside_a_preset_file_fails_at_compose_time(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "experiment" / "typo.yaml").write_text("# @package _global_\noptimizer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigCompositionException) as error:
        _compose(["experiment=typo"], config_dir=conf)
    assert "Key 'learning_rate' not in 'OptimizerConfig'" in str(error.value.__cause__ or error.value)


def test_missing_dataset_root_fails_when_typed() -> None:
    with pytest.raises(MissingMandatoryValue) as error:
        _train_config(["dataset=lerobot"])
    assert "full_key: dataset.root" in str(error.value)


def test_a_saved_train_config_is_typed_too() -> None:
    """Resume reads train_config.json through the same schema: edits with typos or wrong types fail."""
    with pytest.raises(ConfigKeyError, match="Key 'stepz' not in 'TrainConfig'"):
        to_train_config(OmegaConf.create({"stepz": 3}))
    with pytest.raises(ValidationError, match="Value 'many' of type 'str' could not be converted to Integer"):
        to_train_config(OmegaConf.create({"parallelism": {"dp_shard": "many"}}))


# --- LeRobot's --key=value spelling -------------------------------------------------------------------------


def test_normalize_argv_turns_dashed_keys_into_overrides_and_leaves_hydra_flags() -> None:
    argv = [
        "--steps=100",
        "--parallelism.dp_shard=4",
        "batch_size=2",
        "--accelerator.fsdp.wrap_modules=[ACTEncoderLayer]",
        "--config-name=train",
        "--cfg=job",
        "--multirun",
        "-m",
        "--help",
        "--not-a-key=1",
    ]
    assert normalize_argv(argv) == [
        "steps=100",
        "parallelism.dp_shard=4",
        "batch_size=2",
        "accelerator.fsdp.wrap_modules=[ACTEncoderLayer]",
        "--config-name=train",
        "--cfg=job",
        "--multirun",
        "-m",
        "--help",
        "--not-a-key=1",
    ]


def test_dashed_spelling_composes_like_the_hydra_spelling() -> None:
    dashed = _train_config(
        normalize_argv([*VALID, "--steps=100", "--parallelism.dp_shard=4", "--batch_size=2"])
    )
    plain = _train_config([*VALID, "steps=100", "parallelism.dp_shard=4", "batch_size=2"])
    assert dashed == plain
    assert (dashed.steps, dashed.parallelism.dp_shard, dashed.batch_size) == (100, 4, 2)


# --- every validation error names the key, the value and the fix --------------------------------------------


def test_the_valid_runs_pass() -> None:
    validate(_train_config(VALID), world_size=1)
    validate(_train_config(VALID), world_size=2)  # DDP over 2 processes
    validate(_train_config(SHARDED), world_size=2)
    validate(_train_config([*VALID, "parallelism=hsdp", "parallelism.dp_shard=2"]), world_size=4)


# (id, overrides, world size, the message's start "key=value: problem", its fix)
ERRORS: list[tuple[str, list[str], int, str, str]] = [
    # the layout
    (
        "dp_replicate_below_1",
        [*VALID, "parallelism.dp_replicate=0"],
        1,
        "parallelism.dp_replicate=0: must be >= 1",
        "parallelism.dp_replicate=1",
    ),
    (
        "dp_shard_zero",
        [*VALID, "parallelism.dp_shard=0"],
        1,
        "parallelism.dp_shard=0: must be >= 1, or -1 for all processes",
        "parallelism.dp_shard=-1",
    ),
    (
        "dp_shard_below_minus_1",
        [*VALID, "parallelism.dp_shard=-2"],
        1,
        "parallelism.dp_shard=-2: must be >= 1, or -1 for all processes",
        "parallelism.dp_shard=-1",
    ),
    (
        "dp_replicate_not_dividing_world",
        [*VALID, "parallelism=hsdp"],
        3,
        "parallelism.dp_replicate=2: does not divide the 3 processes the launcher started",
        "parallelism.dp_replicate=<a divisor of 3>",
    ),
    (
        "dp_degrees_mismatch_world",
        [*VALID, "parallelism.dp_replicate=2", "parallelism.dp_shard=2"],
        2,
        "parallelism={'dp_replicate': 2, 'dp_shard': 2}: dp_replicate x dp_shard = 4 but the launcher "
        "started 2 process(es)",
        "parallelism.dp_shard=-1 (shard over all processes), or launch 4 processes "
        "(torchrun --nproc-per-node=...)",
    ),
    (
        "dp_shard_above_world",
        [*VALID, "parallelism.dp_shard=4"],
        2,
        "parallelism={'dp_replicate': 1, 'dp_shard': 4}: dp_replicate x dp_shard = 4 but the launcher "
        "started 2",
        "parallelism.dp_shard=-1 (shard over all processes), or launch 4 processes "
        "(torchrun --nproc-per-node=...)",
    ),
    # the loop
    ("steps", [*VALID, "steps=0"], 1, "steps=0: must be >= 1", "steps=<a positive integer>"),
    (
        "batch_size",
        [*VALID, "batch_size=0"],
        1,
        "batch_size=0: must be >= 1",
        "batch_size=<a positive integer>",
    ),
    ("log_freq", [*VALID, "log_freq=-1"], 1, "log_freq=-1: must be >= 1", "log_freq=<a positive integer>"),
    ("num_workers", [*VALID, "num_workers=-1"], 1, "num_workers=-1: must be >= 0", "num_workers=0"),
    # the accelerator
    (
        "mixed_precision",
        [*VALID, "accelerator.mixed_precision=fp8"],
        1,
        "accelerator.mixed_precision='fp8': must be one of ('no', 'bf16', 'fp16')",
        "accelerator.mixed_precision=bf16",
    ),
    (
        "gradient_accumulation",
        [*VALID, "accelerator.gradient_accumulation.steps=0"],
        1,
        "accelerator.gradient_accumulation.steps=0: must be >= 1",
        "accelerator.gradient_accumulation.steps=1",
    ),
    (
        "wrap_and_min_num_params",
        [*SHARDED, "accelerator.fsdp.wrap_modules=[ACTEncoderLayer]", "accelerator.fsdp.min_num_params=1000"],
        2,
        "accelerator.fsdp.min_num_params=1000: cannot be combined with accelerator.fsdp.wrap_modules "
        "(choose one wrap policy)",
        "remove accelerator.fsdp.min_num_params or accelerator.fsdp.wrap_modules",
    ),
    (
        "empty_wrap_modules",
        [*SHARDED, "accelerator.fsdp.wrap_modules=[]"],
        2,
        "accelerator.fsdp.wrap_modules=[]: names no class: only the root would be wrapped",
        "accelerator.fsdp.wrap_modules='[\"MyBlock\"]'",
    ),
    (
        "min_num_params_below_1",
        [*SHARDED, "accelerator.fsdp.min_num_params=0"],
        2,
        "accelerator.fsdp.min_num_params=0: must be >= 1",
        "accelerator.fsdp.min_num_params=1000000",
    ),
    (
        "unknown_policy_dtype",
        [*SHARDED, "accelerator.fsdp.mixed_precision_policy.reduce_dtype=fp32"],
        2,
        "accelerator.fsdp.mixed_precision_policy.reduce_dtype='fp32': must be one of "
        "('float32', 'bfloat16', 'float16')",
        "accelerator.fsdp.mixed_precision_policy.reduce_dtype=bfloat16",
    ),
    (
        "float16_without_fp16",
        [*SHARDED, "accelerator=bf16", "accelerator.fsdp.mixed_precision_policy.param_dtype=float16"],
        2,
        "accelerator.fsdp.mixed_precision_policy.param_dtype='float16': float16 needs the loss scaler, "
        "which only accelerator.mixed_precision=fp16 builds",
        "accelerator.mixed_precision=fp16",
    ),
    (
        "float16_output_without_fp16",
        [*SHARDED, "accelerator.fsdp.mixed_precision_policy.output_dtype=float16"],
        2,
        "accelerator.fsdp.mixed_precision_policy.output_dtype='float16': float16 needs the loss scaler",
        "accelerator.mixed_precision=fp16",
    ),
    # the checkpoint
    (
        "checkpoint_format",
        [*VALID, "checkpoint.format=pickle"],
        1,
        "checkpoint.format='pickle': must be one of ('safetensors', 'dcp', 'safetensors_dcp')",
        "checkpoint.format=safetensors",
    ),
    (
        "save_freq",
        [*VALID, "checkpoint.save_freq=0"],
        1,
        "checkpoint.save_freq=0: must be >= 1",
        "checkpoint.save_freq=1000",
    ),
    (
        "keep_last",
        [*VALID, "checkpoint.keep_last=0"],
        1,
        "checkpoint.keep_last=0: must be >= 1 (or null to keep all)",
        "checkpoint.keep_last=null",
    ),
    # data, optimizer, scheduler, logging, eval
    (
        "dataset_name",
        [*VALID, "dataset.name=hub"],
        1,
        "dataset.name='hub': must be one of ('embedded', 'lerobot')",
        "dataset=lerobot",
    ),
    (
        "missing_dataset_root",
        [*VALID, "dataset.root=/nonexistent/pusht"],
        1,
        "dataset.root='/nonexistent/pusht': is not a LeRobot v3.0 dataset (no meta/info.json)",
        "dataset.root=<a LeRobot v3.0 dataset directory containing meta/info.json>",
    ),
    (
        "missing_embedded_dataset",
        ["dataset=embedded", "dataset.root=/nonexistent/aloha"],
        1,
        "dataset.root='/nonexistent/aloha': is not a LeRobot v3.0 dataset (no meta/info.json)",
        "generate it first: lerobot-mg-make-dataset (or make train does it)",
    ),
    (
        "optimizer_type",
        [*VALID, "optimizer.type=sgd"],
        1,
        "optimizer.type='sgd': only adamw is available",
        "optimizer=adamw",
    ),
    ("lr", [*VALID, "optimizer.lr=0"], 1, "optimizer.lr=0.0: must be > 0", "optimizer.lr=1e-4"),
    (
        "grad_clip_norm",
        [*VALID, "optimizer.grad_clip_norm=-1"],
        1,
        "optimizer.grad_clip_norm=-1.0: must be >= 0 (0 disables clipping)",
        "optimizer.grad_clip_norm=10",
    ),
    (
        "scheduler_type",
        [*VALID, "scheduler.type=linear"],
        1,
        "scheduler.type='linear': must be one of ('none', 'constant', 'cosine')",
        "scheduler=cosine",
    ),
    (
        "warmup_not_below_steps",
        [*VALID, "steps=50", "scheduler=cosine", "scheduler.num_warmup_steps=100"],
        1,
        "scheduler.num_warmup_steps=100: must be in [0, steps=50)",
        "scheduler.num_warmup_steps=<fewer than steps>",
    ),
    (
        "warmup_equal_to_steps",
        [*VALID, "steps=10", "scheduler.num_warmup_steps=10"],
        1,
        "scheduler.num_warmup_steps=10: must be in [0, steps=10)",
        "scheduler.num_warmup_steps=<fewer than steps>",
    ),
    (
        "warmup_negative",
        [*VALID, "scheduler.num_warmup_steps=-1"],
        1,
        "scheduler.num_warmup_steps=-1: must be in [0, steps=50)",
        "scheduler.num_warmup_steps=<fewer than steps>",
    ),
    (
        "min_lr_ratio",
        [*VALID, "scheduler.min_lr_ratio=1.5"],
        1,
        "scheduler.min_lr_ratio=1.5: must be in [0, 1]",
        "scheduler.min_lr_ratio=0",
    ),
    (
        "wandb_mode",
        [*VALID, "logging.wandb.mode=cloud"],
        1,
        "logging.wandb.mode='cloud': must be one of ('offline', 'online', 'disabled')",
        "logging.wandb.mode=offline",
    ),
    (
        "eval_episodes_negative",
        [*VALID, "eval.n_episodes=-1"],
        1,
        "eval.n_episodes=-1: must be >= 0",
        "eval.n_episodes=0",
    ),
    (
        "eval_on_non_embedded_dataset",
        [*VALID, "eval.n_episodes=5"],
        1,
        "eval.n_episodes=5: evaluation runs the ALOHA transfer-cube simulation, which only matches the "
        "embedded dataset",
        "eval.n_episodes=0, or dataset=embedded",
    ),
    # resume and the run directory
    (
        "resume_without_config_path",
        [*VALID, "resume=true"],
        1,
        "config_path=None: resume=true needs the train_config.json of the checkpoint to resume",
        "config_path=<run>/checkpoints/last/pretrained_model/train_config.json",
    ),
    (
        "resume_from_missing_config",
        [*VALID, "resume=true", "config_path=/nonexistent/train_config.json"],
        1,
        "config_path='/nonexistent/train_config.json': does not exist",
        "config_path=<run>/checkpoints/last/pretrained_model/train_config.json",
    ),
    # accumulation boundaries, optimizer shape, evaluation needs
    (
        "steps_not_a_multiple_of_accumulation",
        [*VALID, "steps=10", "accelerator.gradient_accumulation.steps=4"],
        1,
        "steps=10: is not a multiple of accelerator.gradient_accumulation.steps=4",
        "steps=12",
    ),
    (
        "save_inside_an_accumulation_window",
        [*VALID, "steps=12", "checkpoint.save_freq=6", "accelerator.gradient_accumulation.steps=4"],
        1,
        "checkpoint.save_freq=6: is not a multiple of accelerator.gradient_accumulation.steps=4",
        "checkpoint.save_freq=8",
    ),
    (
        "betas_not_two_values",
        [*VALID, "optimizer.betas=[0.9]"],
        1,
        "optimizer.betas=[0.9]: must be two values in [0, 1)",
        "optimizer.betas=[0.9,0.999]",
    ),
    (
        "eval_without_a_gathered_checkpoint",
        [*VALID, "dataset.name=embedded", "eval.n_episodes=5", "checkpoint.save_checkpoint=false"],
        1,
        "eval.n_episodes=5: evaluation loads the last checkpoint's model.safetensors, which this run does not write",
        "checkpoint.save_checkpoint=true with checkpoint.format=safetensors or safetensors_dcp, or eval.n_episodes=0",
    ),
    (
        "config_path_without_resume",
        [*VALID, f"config_path={PUSHT_SLICE / 'meta' / 'info.json'}"],
        1,
        f"config_path='{PUSHT_SLICE / 'meta' / 'info.json'}': is only read when resuming",
        "resume=true, or remove config_path",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "world_size", "start", "fix"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_validation_error_names_the_key_the_value_and_the_fix(
    overrides: list[str], world_size: int, start: str, fix: str
) -> None:
    message = _validation_error(overrides, world_size)
    assert message.startswith(start), message
    assert message.endswith(f". Fix: {fix}"), message


# Options that only mean something for a sharded run, each refused on a DDP run of 2 processes.
FSDP_ONLY = [
    ("accelerator.fsdp.wrap_modules=[ACTEncoderLayer]", "accelerator.fsdp.wrap_modules=['ACTEncoderLayer']"),
    ("accelerator.fsdp.min_num_params=1000", "accelerator.fsdp.min_num_params=1000"),
    ("accelerator.fsdp.cpu_offload=true", "accelerator.fsdp.cpu_offload=True"),
    (
        "accelerator.fsdp.ignored_modules=model\\.encoder",
        "accelerator.fsdp.ignored_modules='model\\\\.encoder'",
    ),
    ("accelerator.fsdp.reshard_after_forward=false", "accelerator.fsdp.reshard_after_forward=False"),
    (
        "accelerator.fsdp.mixed_precision_policy.param_dtype=bfloat16",
        "accelerator.fsdp.mixed_precision_policy='set'",
    ),
]


@pytest.mark.parametrize(
    ("override", "start"), FSDP_ONLY, ids=[o.split("=")[0].split(".")[-1] for o, _ in FSDP_ONLY]
)
def test_fsdp_option_on_a_non_sharded_run_is_refused(override: str, start: str) -> None:
    message = _validation_error([*VALID, override], world_size=2)
    key = start.split("=")[0]
    unit_rule = key.endswith(("wrap_modules", "min_num_params"))
    aside = " (or to choose the units of accelerator.activation_checkpointing / accelerator.compile)"
    assert message.startswith(
        f"{start}: only applies to sharded runs{aside if unit_rule else ''}, and this run is not sharded "
        "(parallelism.dp_shard=1)"
    ), message
    assert message.endswith(f". Fix: parallelism.dp_shard=-1 to shard, or remove {key}")
    validate(_train_config([*VALID, override, "parallelism=fsdp"]), world_size=2)  # the fix works
    if unit_rule:  # the unit rules also choose what activation checkpointing recomputes, sharded or not
        validate(_train_config([*VALID, override, "accelerator.activation_checkpointing=true"]), world_size=2)


@pytest.mark.parametrize("checkpoint_format", ["dcp", "safetensors_dcp"])
def test_dcp_checkpoint_on_a_non_sharded_run_is_refused(checkpoint_format: str) -> None:
    message = _validation_error([*VALID, f"checkpoint={checkpoint_format}"], world_size=2)
    assert message == (
        f"checkpoint.format={checkpoint_format!r}: DCP weight shards only exist for sharded runs; "
        "this run is not sharded (parallelism.dp_shard=1). Fix: checkpoint.format=safetensors, or shard with "
        "parallelism.dp_shard=-1"
    )


def test_existing_output_dir_without_resume_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    validate(_train_config([*VALID, f"output_dir={run_dir}"]), world_size=1)  # empty: fine
    (run_dir / "train_config.json").write_text("{}")
    message = _validation_error([*VALID, f"output_dir={run_dir}"])
    assert message == (
        f"output_dir={str(run_dir)!r}: already exists and is not empty; two runs must never share a run "
        "directory. Fix: a new output_dir, or resume=true "
        "config_path=<output_dir>/checkpoints/last/pretrained_model/train_config.json"
    )


def test_policy_errors_name_the_policy_key() -> None:
    with pytest.raises(ConfigError, match=r"policy.n_action_steps=20 exceeds policy.chunk_size=10"):
        validate(_train_config([*VALID, "policy.n_action_steps=20"]), world_size=1)


def test_a_reduce_dtype_needs_a_param_dtype() -> None:
    with pytest.raises(ConfigError, match=r"reduce_dtype='float32': is set without param_dtype.*float32 compute"):
        validate(_train_config([*SHARDED, "accelerator.fsdp.mixed_precision_policy.reduce_dtype=float32"]), 2)
    validate(_train_config([*SHARDED, "accelerator.fsdp.mixed_precision_policy.param_dtype=bfloat16",
                            "accelerator.fsdp.mixed_precision_policy.reduce_dtype=float32"]), 2)


def test_the_guides_flat_checkpoint_flags_map_to_the_checkpoint_group() -> None:
    assert normalize_argv(["--checkpoint_format=dcp", "--save_freq=500"]) == [
        "checkpoint.format=dcp",
        "checkpoint.save_freq=500",
    ]
