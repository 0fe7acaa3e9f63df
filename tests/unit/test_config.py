"""The Hydra config tree and every user-facing config check.

Every preset in conf/ composes into the typed ``TrainConfig`` and validates; typos and wrong types fail at
compose time; LeRobot's ``--key=value`` spelling works; every ``ValueError`` of
:mod:`lerobot_mg.config.validate` names the dotted key, the bad value and the override that fixes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from lerobot_mg import preflight as preflight_module
from lerobot_mg.config import register_configs
from lerobot_mg.config.loading import (
    CONF_DIR,
    merge_resume_config,
    normalize_argv,
    to_train_config,
    train_config_to_dict,
)
from lerobot_mg.config.schema import POLICY_CONFIGS, TrainConfig
from lerobot_mg.config.validate import NOT_SHARDED
from lerobot_mg.distributed.parallel_dims import Layout, ParallelDims
from lerobot_mg.errors import ConfigError
from lerobot_mg.peft.base import apply_policy_path
from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from lerobot_mg.preflight import preflight
from tests.launch_utils import PUSHT_SLICE
from tests.lerobot_fixtures import FIXTURES

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
        preflight(cfg, world_size)
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
# pi0 and pi0.5 at full size do not fit a CPU test machine (the preflight refuses them): their tiny structure.
PI_TINY = [f"policy.dimension_overrides.{part}.{size}={value}" for part, sizes in {
    "gemma_2b": {"width": 64, "depth": 2, "mlp_dim": 128, "head_dim": 16},
    "gemma_300m": {"width": 32, "depth": 2, "mlp_dim": 64, "head_dim": 16},
    "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
    "text": {"vocab_size": 300}}.items() for size, value in sizes.items()] + ["policy.image_resolution=[42,42]"]
# Their tokenizers are the fixtures' local ones (the Hub's are never fetched in tests).
LAUNCH_FOR[("policy", "pi0")] = LAUNCH_FOR[("policy", "pi05")] = (
    1, [*PI_TINY, f"policy.tokenizer_name={FIXTURES / 'pi0_tiny' / 'tiny_tokenizer'}"])
LAUNCH_FOR[("policy", "smolvla")] = (1, [f"policy.vlm_model_name={FIXTURES / 'smolvla_tiny' / 'tiny_vlm'}"])


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
def test_every_preset_composes_into_the_schema_and_validates(group: str, option: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    world_size, extra = LAUNCH_FOR.get((group, option), (1, []))
    if (group, option) == ("peft", "lora"):  # LoRA fine-tunes a base: give it a (tiny) one
        policy = ACTPolicy(ACTConfig(chunk_size=10, n_action_steps=10, dim_model=16, n_heads=2, dim_feedforward=32),
                           {"observation.state": {"type": "STATE", "shape": [2]}},
                           {"action": {"type": "ACTION", "shape": [2]}})
        policy.save_pretrained(tmp_path / "pretrained_model")
        extra = [*extra, f"policy.path={tmp_path / 'pretrained_model'}"]
    # The dataset root is replaced by the PushT slice so that the validation below finds a real dataset.
    # A mixture's sources: the slice's first two episodes and its third (one episode in two sources is refused).
    data = ([f"dataset.sources=[{{root: {PUSHT_SLICE}, episodes: [0, 1]}}, {{root: {PUSHT_SLICE}, episodes: [2]}}]"]
            if (group, option) == ("dataset", "mixture") else [f"dataset.root={PUSHT_SLICE}"])
    composed = _compose([f"{group}={option}", *extra, *data])
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
            preset.pop("root", None)
        _assert_subset(preset, actual[group], group)

    if (group, option) == ("experiment", "pi05_libero"):  # a Hub base at full size: tests/unit/test_vla_presets.py
        return
    if "policy.path" in " ".join(extra):  # as a launch composes it: the base's config is the policy group
        composed = apply_policy_path(composed, extra)
    cfg = to_train_config(composed)
    assert isinstance(cfg, TrainConfig)
    # The slice stands in for the preset's dataset: the policy reads those of its inputs that the slice has.
    pusht_features = json.loads((PUSHT_SLICE / "meta" / "info.json").read_text())["features"]
    if cfg.policy.observation_keys is not None:
        # The slice's camera stands in for a camera it lacks (the VLA presets read the ALOHA demos' top camera).
        keys = [key if key in pusht_features or not key.startswith("observation.images.") else "observation.image"
                for key in cfg.policy.observation_keys]
        cfg.policy.observation_keys = [key for key in dict.fromkeys(keys) if key in pusht_features] or None
    # The slice is no task of the simulation: the check of an evaluating preset's task is tests/sim's.
    monkeypatch.setattr(preflight_module, "check_sim_evaluation", lambda cfg, features: None)
    preflight(cfg, world_size)


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "normalization_mapping":
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


GROUP_PRESETS = [(group, option) for group, option in PRESETS if group != "experiment"]


@pytest.mark.parametrize(("group", "option"), GROUP_PRESETS, ids=[f"{g}={o}" for g, o in GROUP_PRESETS])
def test_a_preset_states_only_what_it_changes_from_the_schema(group: str, option: str) -> None:
    """Defaults live once, in the schema dataclasses: a preset restating one would keep its own copy when the
    schema's changes (the default presets of conf/train.yaml state nothing but the embedded dataset's root)."""
    register_configs()
    schema = OmegaConf.structured(POLICY_CONFIGS[option] if group == "policy" else TrainConfig)
    defaults = _flat(OmegaConf.to_container(schema if group == "policy" else schema[group]))
    preset = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    preset.pop("defaults", None)
    restated = {key: value for key, value in _flat(preset).items() if defaults.get(key, object()) == value}
    assert not restated, f"conf/{group}/{option}.yaml restates schema defaults {restated}"
    train_defaults = OmegaConf.load(CONF_DIR / "train.yaml").defaults
    if {group: option} in train_defaults and (group, option) != ("dataset", "embedded"):
        assert not preset, f"conf/{group}/{option}.yaml is the default preset: it should equal the schema"


def test_defaults_are_the_offline_single_process_run() -> None:
    cfg = _train_config([f"dataset.root={PUSHT_SLICE}"])
    assert (cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard) == (1, None)  # DDP over what was launched
    assert cfg.accelerator.mixed_precision == "no"
    assert (cfg.checkpoint.format, cfg.dataset.name) == ("safetensors", "embedded")
    # ACT's training preset (use_policy_training_preset): LeRobot's AdamW at 1e-5 without a schedule
    assert (cfg.optimizer.lr, cfg.scheduler.type, cfg.training_recipe.preset) == (1e-5, "none", "act")
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


def test_dataset_lerobot_composes_without_a_root_or_repo_id_and_preflight_refuses_it() -> None:
    """No root is typed: not the embedded demos' directory (the row dataset_lerobot_without_root_or_repo_id of
    tests/unit/test_bad_inputs.py is the refusal)."""
    cfg = _train_config(["dataset=lerobot"])
    assert (cfg.dataset.name, cfg.dataset.root, cfg.dataset.repo_id) == ("lerobot", None, None)


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
    preflight(_train_config(VALID), world_size=1)
    preflight(_train_config(VALID), world_size=2)  # DDP over 2 processes
    preflight(_train_config(SHARDED), world_size=2)
    preflight(_train_config([*VALID, "parallelism=hsdp", "parallelism.dp_shard=2"]), world_size=4)


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
        f"({NOT_SHARDED})"
    ), message
    assert message.endswith(f". Fix: parallelism.dp_shard=-1 to shard, or remove {key}")
    preflight(_train_config([*VALID, override, "parallelism=fsdp"]), world_size=2)  # the fix works
    # ... on one process too, once a launcher started it (FSDP2 on a 1-rank mesh); never without one.
    preflight(_train_config([*VALID, override, "parallelism=fsdp"]), world_size=1, launched=True)
    if not unit_rule:
        assert _validation_error([*VALID, override, "parallelism=fsdp"], world_size=1).startswith(
            f"{start}: only applies to sharded runs")
    if unit_rule:  # the unit rules also choose what activation checkpointing recomputes, sharded or not
        preflight(_train_config([*VALID, override, "accelerator.activation_checkpointing=true"]), world_size=2)


@pytest.mark.parametrize("checkpoint_format", ["dcp", "safetensors_dcp"])
def test_dcp_checkpoint_on_a_non_sharded_run_is_refused(checkpoint_format: str) -> None:
    message = _validation_error([*VALID, f"checkpoint={checkpoint_format}"], world_size=2)
    assert message == (
        f"checkpoint.format={checkpoint_format!r}: DCP weight shards only exist for sharded runs; "
        f"this run is not sharded ({NOT_SHARDED}). Fix: checkpoint.format=safetensors, or shard with "
        "parallelism.dp_shard=-1 under a launcher (torchrun, accelerate launch, SLURM; on one process that is FSDP2 "
        "on a 1-rank mesh)"
    )
    # A sharding typed on one launched process is FSDP2 on a 1-rank mesh: its DCP shards are what it saves.
    preflight(_train_config([*VALID, f"checkpoint={checkpoint_format}", "parallelism.dp_shard=1"]), world_size=1,
              launched=True)
    # Without a launcher (plain python) there is no process group to shard over.
    assert "this run is not sharded" in _validation_error(
        [*VALID, f"checkpoint={checkpoint_format}", "parallelism.dp_shard=1"], world_size=1)


def test_existing_output_dir_without_resume_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    preflight(_train_config([*VALID, f"output_dir={run_dir}"]), world_size=1)  # empty: fine
    (run_dir / "train_config.json").write_text("{}")
    message = _validation_error([*VALID, f"output_dir={run_dir}"])
    assert message == (
        f"output_dir={str(run_dir)!r}: already exists and is not empty; two runs must never share a run "
        "directory. Fix: a new output_dir, or resume=true "
        "config_path=<output_dir>/checkpoints/last/pretrained_model/train_config.json"
    )


def test_policy_errors_name_the_policy_key() -> None:
    with pytest.raises(ConfigError, match=r"policy.n_action_steps=20: exceeds policy.chunk_size=10"):
        preflight(_train_config([*VALID, "policy.n_action_steps=20"]), world_size=1)


def test_a_reduce_dtype_needs_a_param_dtype() -> None:
    with pytest.raises(ConfigError, match=r"reduce_dtype='float32': is set without param_dtype.*float32 compute"):
        preflight(_train_config([*SHARDED, "accelerator.fsdp.mixed_precision_policy.reduce_dtype=float32"]), 2)
    preflight(_train_config([*SHARDED, "accelerator.fsdp.mixed_precision_policy.param_dtype=bfloat16",
                            "accelerator.fsdp.mixed_precision_policy.reduce_dtype=float32"]), 2)


def test_the_guides_flat_checkpoint_flags_map_to_the_checkpoint_group() -> None:
    assert normalize_argv(["--checkpoint_format=dcp", "--save_freq=500"]) == [
        "checkpoint.format=dcp",
        "checkpoint.save_freq=500",
    ]


@pytest.mark.parametrize("saved_dp_shard", [1, None], ids=["older_run", "unset"])
def test_a_saved_train_config_resumes_with_its_layout(saved_dp_shard: int | None, tmp_path: Path) -> None:
    """Every train_config.json written before dp_shard could be unset says ``dp_shard: 1``: it still composes, and
    resumes as the DDP (or single process) it ran as; a newer one says null."""
    saved = train_config_to_dict(_train_config(VALID))
    saved["parallelism"]["dp_shard"] = saved_dp_shard
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps(saved))
    typed = ["resume=true", f"config_path={path}"]
    cfg = to_train_config(merge_resume_config(_compose(typed), typed))
    assert (cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard) == (1, saved_dp_shard)
    degrees = (cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard)
    assert ParallelDims.resolve(*degrees, 1).layout is Layout.SINGLE  # python scripts/train.py
    assert ParallelDims.resolve(*degrees, 2, launched=True).layout is Layout.DDP  # torchrun --nproc-per-node=2
