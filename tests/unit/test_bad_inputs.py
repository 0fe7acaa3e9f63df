"""The bad-input catalogue (docs/errors.md): misconfigurations a user can type, each refused before any process
group exists with one line that names the dotted key (or variable, or file), the bad value and the override that
fixes it.

Most rows run the launch's own checks in this process, in the order ``scripts/train.py`` runs them (preset names,
compose, the resume merge, the run config, then ``preflight``: the environment guard, the config, the dataset, the
resume point and the memory plan); a handful go through the real
command to show the exit status 2 and the single line without a traceback, the three sources of accelerate
configuration among them (an exported variable, ``accelerate launch --config_file``, and accelerate's default config
under ``$HF_HOME``). docs/errors.md lists every row.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lerobot_mg.checkpoint.dcp_io import save_dcp
from lerobot_mg.checkpoint.unpickle import read_dcp_metadata
from lerobot_mg.config import register_configs
from lerobot_mg.config.loading import (
    CONF_DIR,
    check_choices,
    check_presets,
    merge_resume_config,
    override_keys,
    run_config,
    train_config_to_dict,
)
from lerobot_mg.distributed.device import precision_unsupported
from lerobot_mg.errors import ConfigError
from lerobot_mg.preflight import preflight
from lerobot_mg.run_facts import Progress
from tests.launch_utils import PUSHT_SLICE, PYTHON, REPO, TRAIN_SCRIPT, clean_env, free_port, kill_tree
from tests.vla_preset_aids import write_vla_dataset

VALID = ["experiment=pusht_debug", f"dataset.root={PUSHT_SLICE}"]
SHARDED = [*VALID, "parallelism=fsdp"]  # on 2 processes
ERRORS_DOC = REPO / "docs" / "errors.md"
# An accelerate config file as `accelerate config` writes it for a one-process run in bf16.
ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: bf16
num_machines: 1
num_processes: 1
use_cpu: true
"""


@dataclass(frozen=True)
class BadInput:
    """One row: what the user typed, the message's start (``key=value: problem``) and its fix (after ``Fix: ``)."""

    id: str
    typed: list[str]
    start: str
    fix: str
    world_size: int = 1
    env: dict[str, str] = field(default_factory=dict)
    make: Callable[[Path], None] | None = None  # writes the files the row refers to under <tmp>


def _v21_dataset(tmp: Path) -> None:
    shutil.copytree(PUSHT_SLICE / "meta", tmp / "v21" / "meta")
    info = json.loads((tmp / "v21" / "meta" / "info.json").read_text())
    (tmp / "v21" / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v2.1"}))


def _saved_act_run(tmp: Path) -> None:
    """The train_config.json of an ACT checkpoint (only the config is read before a resume is refused)."""
    saved = tmp / "run" / "checkpoints" / "last" / "pretrained_model"
    saved.mkdir(parents=True)
    (saved / "train_config.json").write_text(json.dumps(train_config_to_dict(_run_config(VALID, 1))))


class _Payload:
    """Pickles as ``os.system("touch <tmp>/payload_ran")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def _planted_dcp_checkpoint(tmp: Path) -> None:
    """A complete-looking checkpoint.format=dcp checkpoint whose model .metadata is a pickle that runs a command."""
    _saved_act_run(tmp)
    step_dir = tmp / "run" / "checkpoints" / "last"
    (step_dir / "training_state").mkdir()
    (step_dir / "training_state" / "training_step.json").write_text(json.dumps({
        "step": 4, "progress": asdict(Progress(step=4)), "sampler": {"epoch": 0, "position": 4},
        "facts": {"topology": {"dp_replicate": 1, "dp_shard": 2, "world_size": 2}}}))
    (step_dir / "pretrained_model" / "pytorch_model_fsdp_0").mkdir()
    (step_dir / "pretrained_model" / "pytorch_model_fsdp_0" / ".metadata").write_bytes(
        pickle.dumps(_Payload(tmp / "payload_ran")))


def _dcp_checkpoint_with_a_shard_path_out(tmp: Path) -> None:
    """A complete-looking checkpoint.format=dcp checkpoint whose model .metadata places its item in a shard file
    outside the checkpoint."""
    _planted_dcp_checkpoint(tmp)
    dcp_dir = tmp / "run" / "checkpoints" / "last" / "pretrained_model" / "pytorch_model_fsdp_0"
    (dcp_dir / ".metadata").unlink()  # the planted pickle: a real checkpoint's instead
    save_dcp({"w": torch.zeros(2)}, dcp_dir, no_dist=True)
    metadata = read_dcp_metadata(dcp_dir)
    metadata.storage_data = {index: replace(info, relative_path="../../elsewhere.distcp")
                             for index, info in metadata.storage_data.items()}
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def _train_config_with_a_missing_value(tmp: Path) -> None:
    _saved_act_run(tmp)
    path = tmp / "run" / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    saved = json.loads(path.read_text())
    saved["policy"]["license"] = "???"
    path.write_text(json.dumps(saved))


def _non_empty_output_dir(tmp: Path) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / "ledger.jsonl").write_text("")


def _v31_dataset(tmp: Path) -> None:
    """The PushT slice's metadata as a LeRobot v3.1 dataset (all a start reads before it refuses the mixture)."""
    shutil.copytree(PUSHT_SLICE / "meta", tmp / "v31" / "meta")
    info = json.loads((tmp / "v31" / "meta" / "info.json").read_text())
    (tmp / "v31" / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v3.1"}))


def _aloha_like_dataset(tmp: Path) -> None:
    """A second robot: 14-dim state and action, a top camera, 50 fps, two episodes of 12 frames."""
    write_vla_dataset(tmp / "aloha")


# dataset=mixture rows: the PushT slice split into two sources by episode (two sources of one robot), typed as the
# list override a user types on the command line; the policy is the default (ACT, which reads every observation).
MIXTURE = "dataset=mixture"


def _sources(*sources: str) -> str:
    return f"dataset.sources=[{', '.join(sources)}]"


PUSHT_01 = f"{{root: {PUSHT_SLICE}, episodes: [0, 1]}}"
PUSHT_2 = f"{{root: {PUSHT_SLICE}, episodes: [2]}}"
TWO_SOURCES = _sources(PUSHT_01, PUSHT_2)


CONFIG = "config_path=<run>/checkpoints/last/pretrained_model/train_config.json"
CATALOGUE = [
    # --- the layout -----------------------------------------------------------------------------------------
    BadInput("degrees_not_the_world", [*VALID, "parallelism.dp_replicate=2", "parallelism.dp_shard=2"],
             "parallelism={'dp_replicate': 2, 'dp_shard': 2}: dp_replicate x dp_shard = 4 but the launcher started 2",
             "parallelism.dp_shard=-1 (shard over all processes), or launch 4 processes (torchrun --nproc-per-node=...)",
             world_size=2),
    BadInput("dp_shard_zero", [*VALID, "parallelism.dp_shard=0"],
             "parallelism.dp_shard=0: must be >= 1, or -1 for all processes", "parallelism.dp_shard=-1"),
    BadInput("dp_shard_below_minus_1", [*VALID, "parallelism.dp_shard=-3"],
             "parallelism.dp_shard=-3: must be >= 1, or -1 for all processes", "parallelism.dp_shard=-1"),
    BadInput("dp_replicate_minus_1", [*VALID, "parallelism.dp_replicate=-1"],
             "parallelism.dp_replicate=-1: must be >= 1", "parallelism.dp_replicate=1"),
    BadInput("dp_replicate_not_dividing_the_world", [*VALID, "parallelism=hsdp", "parallelism.dp_replicate=3"],
             "parallelism.dp_replicate=3: does not divide the 4 processes", "parallelism.dp_replicate=<a divisor of 4>",
             world_size=4),
    BadInput("more_ranks_than_samples", VALID,
             f"dataset.root='{PUSHT_SLICE}': has 420 samples, fewer than the 1000 data-parallel ranks launched",
             "launch at most 420 processes, or a larger dataset", world_size=1000),
    BadInput("dataset_smaller_than_a_global_batch", [*VALID, "batch_size=300"],
             "batch_size=300: one global batch (batch_size x 2 data-parallel ranks = 600 samples) is larger than "
             "the 420 samples", "batch_size=210, or fewer processes", world_size=2),
    # --- checkpoints -----------------------------------------------------------------------------------------
    BadInput("dcp_without_sharding", [*VALID, "checkpoint=dcp"],
             "checkpoint.format='dcp': DCP weight shards only exist for sharded runs",
             "checkpoint.format=safetensors, or shard with parallelism.dp_shard=-1"),
    BadInput("format_in_the_wrong_case", [*SHARDED, "checkpoint.format=DCP"],
             "checkpoint.format='DCP': must be one of safetensors, dcp, safetensors_dcp",
             "checkpoint.format=dcp", world_size=2),
    # --- sharding options ------------------------------------------------------------------------------------
    BadInput("wrap_class_the_policy_lacks", [*SHARDED, "accelerator.fsdp.wrap_modules=[TransformerBlock]"],
             "accelerator.fsdp.wrap_modules=['TransformerBlock']: no module of class ['TransformerBlock'] in "
             "ACTPolicy, whose classes are ['ACT', 'ACTDecoder', 'ACTDecoderLayer', 'ACTDropout', 'ACTEncoder', "
             "'ACTEncoderLayer', 'ACTMultiheadAttention'",
             "accelerator.fsdp.wrap_modules=[<some of those classes>]", world_size=2),
    BadInput("wrap_modules_and_min_num_params", [*SHARDED, "accelerator.fsdp.wrap_modules=[ACTEncoderLayer]",
                                                 "accelerator.fsdp.min_num_params=1000"],
             "accelerator.fsdp.min_num_params=1000: cannot be combined with accelerator.fsdp.wrap_modules",
             "remove accelerator.fsdp.min_num_params or accelerator.fsdp.wrap_modules", world_size=2),
    BadInput("float16_without_fp16", [*SHARDED, "accelerator.fsdp.mixed_precision_policy.param_dtype=float16"],
             "accelerator.fsdp.mixed_precision_policy.param_dtype='float16': float16 needs the loss scaler",
             "accelerator.mixed_precision=fp16", world_size=2),
    BadInput("reduce_dtype_without_param_dtype", [*SHARDED, "accelerator.fsdp.mixed_precision_policy.reduce_dtype=float32"],
             "accelerator.fsdp.mixed_precision_policy.reduce_dtype='float32': is set without param_dtype",
             "accelerator.fsdp.mixed_precision_policy.param_dtype=bfloat16 (or the dtype to compute in)", world_size=2),
    BadInput("fsdp_option_on_ddp", [*VALID, "accelerator.fsdp.cpu_offload=true"],
             "accelerator.fsdp.cpu_offload=True: only applies to sharded runs",
             "parallelism.dp_shard=-1 to shard, or remove accelerator.fsdp.cpu_offload", world_size=2),
    # --- precision and steps ---------------------------------------------------------------------------------
    BadInput("unknown_mixed_precision", [*VALID, "accelerator.mixed_precision=fp8"],
             "accelerator.mixed_precision='fp8': must be one of no, bf16, fp16", "accelerator.mixed_precision=no"),
    BadInput("accumulation_below_1", [*VALID, "accelerator.gradient_accumulation.steps=0"],
             "accelerator.gradient_accumulation.steps=0: must be >= 1", "accelerator.gradient_accumulation.steps=1"),
    BadInput("steps_not_a_multiple_of_accumulation", [*VALID, "accelerator.gradient_accumulation.steps=4",
                                                      "steps=50"],
             "steps=50: is not a multiple of accelerator.gradient_accumulation.steps=4", "steps=52"),
    BadInput("batch_size_zero", [*VALID, "batch_size=0"], "batch_size=0: must be >= 1", "batch_size=<a positive integer>"),
    BadInput("batch_size_negative", [*VALID, "batch_size=-8"], "batch_size=-8: must be >= 1",
             "batch_size=<a positive integer>"),
    BadInput("steps_negative", [*VALID, "steps=-100"], "steps=-100: must be >= 1", "steps=<a positive integer>"),
    BadInput("lr_negative", [*VALID, "optimizer.lr=-1e-4"], "optimizer.lr=-0.0001: must be > 0", "optimizer.lr=1e-4"),
    BadInput("typed_warmup_not_below_steps", [*VALID, "steps=50", "scheduler=cosine",
                                              "scheduler.num_warmup_steps=60"],
             "scheduler.num_warmup_steps=60: must be in [0, steps=50)", "scheduler.num_warmup_steps=<fewer than steps>"),
    # --- resume ----------------------------------------------------------------------------------------------
    BadInput("resume_without_config_path", [*VALID, "resume=true"],
             "config_path=None: resume=true needs the train_config.json of the checkpoint to resume", CONFIG),
    BadInput("config_path_missing", [*VALID, "resume=true", "config_path=<tmp>/nowhere/train_config.json"],
             "config_path='<tmp>/nowhere/train_config.json': does not exist", CONFIG),
    BadInput("config_path_a_directory", [*VALID, "resume=true", "config_path=<tmp>"],
             "config_path='<tmp>': is a directory, not the train_config.json file in it", CONFIG),
    BadInput("resume_into_another_policy", ["resume=true", "policy=diffusion",
                                            "config_path=<tmp>/run/checkpoints/last/pretrained_model/train_config.json"],
             "policy='diffusion': config_path holds a 'act' policy; a resume continues the same policy",
             "remove the policy override, or fine-tune a new run from it: resume=false "
             "policy.path=<the checkpoint's pretrained_model> policy=act", make=_saved_act_run),
    BadInput("resume_an_incomplete_checkpoint",
             ["resume=true", "config_path=<tmp>/run/checkpoints/last/pretrained_model/train_config.json"],
             "<tmp>/run/checkpoints/last/training_state/training_step.json is missing: <tmp>/run/checkpoints/last is "
             "not a complete checkpoint",
             "resume from config_path=<tmp>/run/checkpoints/last/pretrained_model/train_config.json", make=_saved_act_run),
    BadInput("resume_a_checkpoint_that_would_run_code",
             ["resume=true", "config_path=<tmp>/run/checkpoints/last/pretrained_model/train_config.json"],
             "<tmp>/run/checkpoints/last/pretrained_model/pytorch_model_fsdp_0/.metadata: refused to unpickle its "
             "contents: it names posix.system, which a DCP checkpoint never holds and which could run code, so nothing "
             "of it was loaded or run",
             "use a checkpoint from a source you trust (or one whose weights are safetensors: lerobot-mg-convert-dcp on "
             "a trusted machine writes them)", make=_planted_dcp_checkpoint),
    BadInput("config_path_without_resume", [*VALID, f"config_path={PUSHT_SLICE / 'meta' / 'info.json'}"],
             f"config_path='{PUSHT_SLICE / 'meta' / 'info.json'}': is only read when resuming",
             "resume=true, or remove config_path"),
    BadInput("output_dir_of_another_run", [*VALID, "output_dir=<tmp>/out"],
             "output_dir='<tmp>/out': already exists and is not empty",
             "a new output_dir, or resume=true config_path=<output_dir>/checkpoints/last/pretrained_model/"
             "train_config.json", make=_non_empty_output_dir),
    # --- the dataset -----------------------------------------------------------------------------------------
    BadInput("dataset_v21", ["experiment=pusht_debug", "dataset.root=<tmp>/v21"],
             "dataset.root='<tmp>/v21': is a LeRobot v2.1 dataset (meta/info.json codebase_version)",
             "convert it with LeRobot's v2.1 -> v3.0 conversion script", make=_v21_dataset),
    BadInput("dataset_root_missing", ["experiment=pusht_debug", "dataset.root=<tmp>/nowhere"],
             "dataset.root='<tmp>/nowhere': is not a LeRobot v3.0 dataset (no meta/info.json)",
             "dataset.root=<a LeRobot v3.0 dataset directory containing meta/info.json>"),
    BadInput("dataset_lerobot_without_root_or_repo_id", ["experiment=pusht_debug", "dataset.root=null"],
             "dataset.root=None: dataset=lerobot reads a LeRobot v3.0 dataset from a directory or from the Hub, and "
             "neither is given", "dataset.root=<a LeRobot v3.0 dataset directory>, or dataset.repo_id=<user>/<dataset>"),
    BadInput("dataset_repo_id_not_a_repo_id", ["dataset.repo_id=my_dataset"],
             "dataset.repo_id='my_dataset': is not a Hub repo id <user>/<dataset>", "dataset.repo_id=${HF_USER}/my_dataset"),
    BadInput("dataset_repo_id_offline_and_not_cached", ["dataset.repo_id=me/my_dataset"],
             "dataset.repo_id='me/my_dataset': is not in LeRobot's cache (/nonexistent/lerobot/me/my_dataset), and "
             "HF_HUB_OFFLINE=1 forbids downloading it",
             "fetch it while online: hf download me/my_dataset --repo-type dataset --local-dir "
             "/nonexistent/lerobot/me/my_dataset, or dataset.root=<a local copy>",
             env={"HF_HUB_OFFLINE": "1", "HF_LEROBOT_HOME": "/nonexistent/lerobot"}),
    BadInput("dataset_repo_id_over_a_presets_dataset", ["experiment=pusht_debug", "dataset.repo_id=someone/absent"],
             "dataset.repo_id='someone/absent': is set together with dataset.root=",
             "dataset.root=null to read someone/absent from LeRobot's cache or the Hub, or dataset.repo_id=null to "
             "train on the preset's dataset"),
    BadInput("dataset_cache_days_not_a_number", [*VALID], "LEROBOT_MG_CACHE_DAYS='a week': must be a positive "
             "number of days", "export LEROBOT_MG_CACHE_DAYS=30", env={"LEROBOT_MG_CACHE_DAYS": "a week"}),
    # --- publishing (policy.repo_id) -------------------------------------------------------------------------
    BadInput("policy_repo_id_not_a_repo_id", [*VALID, "policy.repo_id=my_trained_policy"],
             "policy.repo_id='my_trained_policy': is not a Hub repo id <user>/<name>",
             "policy.repo_id=${HF_USER}/my_trained_policy"),
    BadInput("push_offline", [*VALID, "policy.repo_id=me/my_trained_policy"],
             "policy.repo_id='me/my_trained_policy': HF_HUB_OFFLINE=1 is set, so the upload at the end of training "
             "could never happen", "unset HF_HUB_OFFLINE (and log in: hf auth login), or policy.push_to_hub=false",
             env={"HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_x"}),
    BadInput("push_without_a_token", [*VALID, "policy.repo_id=me/my_trained_policy"],
             "policy.repo_id='me/my_trained_policy': no Hugging Face token is set (HF_TOKEN, or hf auth login), so the "
             "upload at the end of training would be refused",
             "hf auth login (or export HF_TOKEN=<a write token>), or policy.push_to_hub=false",
             env={"HF_HOME": "/nonexistent/hf"}),
    BadInput("push_without_a_final_checkpoint",
             [*VALID, "policy.repo_id=me/my_trained_policy", "checkpoint.save_checkpoint=false"],
             "policy.repo_id='me/my_trained_policy': publishes the final checkpoint, which "
             "checkpoint.save_checkpoint=false never writes", "checkpoint.save_checkpoint=true, or policy.push_to_hub=false",
             env={"HF_TOKEN": "hf_x"}),
    # --- pi0, pi0.5, SmolVLA -------------------------------------------------------------------------------------
    BadInput("tokenizer_offline_and_not_cached", ["policy=smolvla", f"dataset.root={PUSHT_SLICE}"],
             "policy.vlm_model_name='HuggingFaceTB/SmolVLM2-500M-Video-Instruct': is not in huggingface_hub's cache, "
             "and HF_HUB_OFFLINE=1 forbids downloading its tokenizer",
             'fetch it while online: hf download HuggingFaceTB/SmolVLM2-500M-Video-Instruct --include "tokenizer*" '
             '--include "*.json" --include "merges.txt"',
             env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/nonexistent/hf"}),
    BadInput("gated_tokenizer_offline", ["policy=pi0", f"dataset.root={PUSHT_SLICE}"],
             "policy.tokenizer_name='google/paligemma-3b-pt-224': is not in huggingface_hub's cache, and "
             "HF_HUB_OFFLINE=1 forbids downloading its tokenizer",
             'fetch it while online: hf download google/paligemma-3b-pt-224 --include "tokenizer*" --include "*.json" '
             '--include "merges.txt" (google/paligemma-3b-pt-224 is gated: accept its licence on '
             "https://huggingface.co/google/paligemma-3b-pt-224 first, and log in with that account: hf auth login)",
             env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/nonexistent/hf"}),
    BadInput("relative_actions", ["policy=pi0", "policy.use_relative_actions=true", f"dataset.root={PUSHT_SLICE}"],
             "policy.use_relative_actions=True: lerobot_mg does not train or run relative actions (LeRobot's actions "
             "minus the current state)", "policy.use_relative_actions=false"),
    BadInput("bfloat16_policy_sharded_without_mixed_precision",
             ["policy=pi0", "policy.dtype=bfloat16", "parallelism=fsdp", f"dataset.root={PUSHT_SLICE}"],
             "accelerator.mixed_precision='no': policy.dtype=bfloat16 builds trainable parameters of two dtypes",
             "accelerator=bf16 (or an unsharded layout)", world_size=2),
    BadInput("observation_key_the_dataset_lacks", [*VALID, "policy.observation_keys=[observation.wrist]"],
             "policy.observation_keys=['observation.wrist']: the dataset has no feature ['observation.wrist']",
             "policy.observation_keys=[observation.image,observation.state] or a subset of it"),
    BadInput("chunk_longer_than_the_shortest_episode", [*VALID, "policy.chunk_size=200", "policy.n_action_steps=10"],
             "policy.chunk_size=200: each sample loads 200 action frames, more than the shortest episode",
             "policy.chunk_size=<at most 118>, or dataset.episodes=<longer episodes>"),
    BadInput("unknown_episode", [*VALID, "dataset.episodes=[0,7]"],
             "dataset.episodes=[0, 7]: dataset.root has no episode [7]",
             "dataset.episodes=<indices in 0..2>, or dataset.episodes=null for all"),
    # --- the memory plan -------------------------------------------------------------------------------------
    BadInput("training_state_does_not_fit", [*VALID, "policy.dim_feedforward=100000000"],
             "parallelism.dp_shard=1: each rank holds", "no layout of this world size fits"),
    # --- presets ---------------------------------------------------------------------------------------------
    BadInput("unknown_experiment", ["experiment=pusht_debg"],
             "experiment='pusht_debg': is not a preset in conf/experiment/",
             "experiment=<one of aloha_diffusion, aloha_image, aloha_pi05_tiny, aloha_pi0_tiny, aloha_smolvla_tiny, aloha_state, pi05_libero, pusht_debug, pusht_debug_diffusion>"),
    BadInput("unknown_parallelism", [*VALID, "parallelism=zero3"],
             "parallelism='zero3': is not a preset in conf/parallelism/", "parallelism=<one of ddp, fsdp, hsdp>"),
    # --- accelerate configuration from the environment -------------------------------------------------------
    BadInput("accelerate_variable_exported", VALID,
             "ACCELERATE_MIXED_PRECISION=bf16: accelerate configuration in the environment",
             "put these settings in parallelism.* / accelerator.* overrides", env={"ACCELERATE_MIXED_PRECISION": "bf16"}),
    BadInput("fsdp_variable_exported", VALID,
             "FSDP_SHARDING_STRATEGY=FULL_SHARD: accelerate configuration in the environment",
             "put these settings in parallelism.* / accelerator.* overrides",
             env={"FSDP_SHARDING_STRATEGY": "FULL_SHARD"}),
    BadInput("resume_a_checkpoint_whose_shard_path_leaves_it",
             ["resume=true", "config_path=<tmp>/run/checkpoints/last/pretrained_model/train_config.json"],
             "<tmp>/run/checkpoints/last/pretrained_model/pytorch_model_fsdp_0/.metadata: storage_data['w']."
             "relative_path='../../elsewhere.distcp' climbs out of its folder with '..': a path read from a file must "
             "name a regular file inside <tmp>/run/checkpoints/last/pretrained_model/pytorch_model_fsdp_0, so nothing "
             "was read from it", "use a checkpoint from a source you trust", make=_dcp_checkpoint_with_a_shard_path_out),
    BadInput("resume_a_train_config_with_a_missing_value",
             ["resume=true", "config_path=<tmp>/run/checkpoints/last/pretrained_model/train_config.json"],
             "<tmp>/run/checkpoints/last/pretrained_model/train_config.json: policy.license='???' is OmegaConf's marker "
             "of a missing value, which no saved config holds",
             "a config file written by lerobot_mg or LeRobot 0.6.1 (or give the field a value)",
             make=_train_config_with_a_missing_value),
    # --- dataset=mixture -------------------------------------------------------------------------------------
    BadInput("mixture_without_sources", [MIXTURE],
             "dataset.sources=None: dataset=mixture draws from a list of datasets, and none is given",
             "'dataset.sources=[{root: /data/a, weight: 0.7}, {repo_id: user/b, weight: 0.3}]'"),
    BadInput("mixture_source_with_root_and_repo_id", [MIXTURE, _sources(f"{{root: {PUSHT_SLICE}, repo_id: lerobot/pusht}}")],
             f"dataset.sources.0={{'root': '{PUSHT_SLICE}', 'repo_id': 'lerobot/pusht'}}: names a dataset by exactly "
             "one of root and repo_id",
             "dataset.sources.0.root=<dir>, or dataset.sources.0.repo_id=<user>/<name>"),
    BadInput("mixture_source_without_root_or_repo_id", [MIXTURE, _sources(PUSHT_01, "{weight: 0.5}")],
             "dataset.sources.1={'root': None, 'repo_id': None}: names a dataset by exactly one of root and repo_id",
             "dataset.sources.1.root=<dir>, or dataset.sources.1.repo_id=<user>/<name>"),
    BadInput("mixture_with_dataset_root", [MIXTURE, f"dataset.root={PUSHT_SLICE}", TWO_SOURCES],
             f"dataset.root='{PUSHT_SLICE}': is a single dataset's setting; a mixture reads each source's own",
             "dataset.sources.<i>.root=..., and drop dataset.root"),
    BadInput("mixture_with_dataset_repo_id", [MIXTURE, "dataset.repo_id=lerobot/pusht", TWO_SOURCES],
             "dataset.repo_id='lerobot/pusht': is a single dataset's setting; a mixture reads each source's own",
             "dataset.sources.<i>.repo_id=..., and drop dataset.repo_id"),
    BadInput("mixture_with_dataset_episodes", [MIXTURE, "dataset.episodes=[0]", TWO_SOURCES],
             "dataset.episodes=[0]: is a single dataset's setting; a mixture reads each source's own",
             "dataset.sources.<i>.episodes=..., and drop dataset.episodes"),
    BadInput("mixture_with_val_episodes", [MIXTURE, "dataset.val_episodes=1", TWO_SOURCES],
             "dataset.val_episodes=1: holds episodes out of one dataset; a mixture's validation split is not supported",
             "drop dataset.val_episodes (hold episodes out with dataset.sources.<i>.episodes"),
    BadInput("mixture_weight_negative",
             [MIXTURE, _sources(f"{{root: {PUSHT_SLICE}, episodes: [0, 1], weight: 0.7}}",
                                f"{{root: {PUSHT_SLICE}, episodes: [2], weight: -0.3}}")],
             "dataset.sources.1.weight=-0.3: must be a finite number >= 0",
             "dataset.sources.1.weight=<a probability, e.g. 0.5>"),
    BadInput("mixture_weight_not_a_number", [MIXTURE, _sources(f"{{root: {PUSHT_SLICE}, weight: nan}}")],
             "dataset.sources.0.weight=nan: must be a finite number >= 0",
             "dataset.sources.0.weight=<a probability, e.g. 0.5>"),
    BadInput("mixture_weights_all_zero",
             [MIXTURE, _sources(f"{{root: {PUSHT_SLICE}, episodes: [0, 1], weight: 0}}",
                                f"{{root: {PUSHT_SLICE}, episodes: [2], weight: 0}}")],
             "dataset.sources=['weight=0.0', 'weight=0.0']: weights are all zero: nothing would ever be drawn",
             "dataset.sources.0.weight=1 (any positive weight)"),
    BadInput("mixture_weights_given_to_some_sources",
             [MIXTURE, _sources(f"{{root: {PUSHT_SLICE}, episodes: [0, 1], weight: 0.7}}", PUSHT_2)],
             "dataset.sources=['weight=0.7', 'weight=None']: gives some sources a weight and others none",
             "a weight for every source, or none (each source's share of the frames)"),
    BadInput("mixture_duplicate_source", [MIXTURE, _sources(f"{{root: {PUSHT_SLICE}}}", f"{{root: {PUSHT_SLICE}/}}")],
             f"dataset.sources.1='{PUSHT_SLICE}/': is the same dataset as dataset.sources.0 and shares its episodes "
             "[0, 1, 2]: they would be drawn at both sources' weights",
             "dataset.sources.1.episodes=<episodes dataset.sources.0 does not read>, or drop it and raise "
             "dataset.sources.0.weight"),
    BadInput("mixture_source_of_another_version", [MIXTURE, _sources(f"{{root: {PUSHT_SLICE}}}", "{root: <tmp>/v31}")],
             "dataset.sources.1='<tmp>/v31': is a LeRobot v3.1 dataset, dataset.sources.0 a v3.0 one",
             "convert the older one with LeRobot's conversion script, or drop it", make=_v31_dataset),
    BadInput("mixture_rename_of_an_unknown_key",
             [MIXTURE, _sources(PUSHT_01, f"{{root: {PUSHT_SLICE}, episodes: [2], "
                                          "rename_map: {observation.images.wrist: observation.image}}")],
             "dataset.sources.1.rename_map={'observation.images.wrist': 'observation.image'}: renames "
             f"['observation.images.wrist'], which {PUSHT_SLICE} does not have (its features: ['action', "
             "'next.done', 'next.reward', 'next.success', 'observation.image', 'observation.state'])",
             "dataset.sources.1.rename_map={<a feature of the source>: <the policy's name>}"),
    BadInput("mixture_rename_collision",
             [MIXTURE, _sources(PUSHT_01, f"{{root: {PUSHT_SLICE}, episodes: [2], "
                                          "rename_map: {observation.image: observation.state}}")],
             "dataset.sources.1.rename_map={'observation.image': 'observation.state'}: maps two features of "
             f"{PUSHT_SLICE} onto ['observation.state']",
             "dataset.sources.1.rename_map with a distinct name per feature"),
    BadInput("mixture_rename_of_an_index_feature",
             [MIXTURE, _sources(PUSHT_01, f"{{root: {PUSHT_SLICE}, episodes: [2], rename_map: {{index: step}}}}")],
             "dataset.sources.1.rename_map={'index': 'step'}: renames the index features ['index']",
             "dataset.sources.1.rename_map without ['index']"),
    BadInput("mixture_feature_an_image_in_one_source_and_numbers_in_another",
             [MIXTURE, _sources(PUSHT_01, f"{{root: {PUSHT_SLICE}, episodes: [2], rename_map: "
                                          "{observation.state: observation.image, observation.image: observation.images.top}}")],
             "dataset.sources.1='pusht_image_slice_1': holds observation.image as float32, another source as image",
             "dataset.sources.1.rename_map={observation.state: <another name>}"),
    BadInput("mixture_act_without_a_camera_in_one_source",
             [MIXTURE, _sources(PUSHT_01, f"{{root: {PUSHT_SLICE}, episodes: [2], "
                                          "rename_map: {observation.image: observation.images.top}}")],
             "dataset.sources.0='pusht_image_slice': has no observation.images.top, which policy.type=act reads and "
             "cannot do without",
             "dataset.sources.0.rename_map={<its name for it>: observation.images.top}, policy.observation_keys "
             "without it, or a policy that pads missing inputs (policy=pi0, pi05 or smolvla)"),
    BadInput("mixture_act_with_another_state_size",
             [MIXTURE, "policy.observation_keys=[observation.state]", "policy.chunk_size=4", "policy.n_action_steps=4",
              _sources("{root: <tmp>/aloha}", f"{{root: {PUSHT_SLICE}}}")],
             "dataset.sources.1='pusht_image_slice': holds observation.state of shape [2], another source [14]; "
             "policy.type=act cannot pad it",
             "a policy that pads (policy=pi0, pi05 or smolvla), policy.observation_keys without it, or drop "
             "dataset.sources.1", make=_aloha_like_dataset),
    BadInput("mixture_stats_unknown", [MIXTURE, "dataset.stats=pooled", TWO_SOURCES],
             "dataset.stats='pooled': must be one of merged, per_source", "dataset.stats=merged"),
    BadInput("mixture_smaller_than_a_global_batch", [MIXTURE, "batch_size=300", TWO_SOURCES],
             "batch_size=300: one global batch (batch_size x 2 data-parallel ranks = 600 samples) is larger than the "
             "420 samples of the mixture", "batch_size=210, or fewer processes", world_size=2),
    # A source is resolved and read as one dataset is; its refusals name the source's own keys.
    BadInput("mixture_source_unknown_episode", [MIXTURE, _sources(PUSHT_01, f"{{root: {PUSHT_SLICE}, episodes: [0, 7]}}")],
             "dataset.sources.1.episodes=[0, 7]: dataset.sources.1 has no episode [7] (it has 3: 0..2)",
             "dataset.sources.1.episodes=<indices in 0..2>, or dataset.sources.1.episodes=null for all"),
    BadInput("mixture_source_root_missing", [MIXTURE, _sources(PUSHT_01, "{root: <tmp>/nowhere}")],
             "dataset.sources.1.root='<tmp>/nowhere': is not a LeRobot v3.0 dataset (no meta/info.json)",
             "dataset.sources.1.root=<a LeRobot v3.0 dataset directory containing meta/info.json>"),
    BadInput("mixture_source_repo_id_not_a_repo_id", [MIXTURE, _sources(PUSHT_01, "{repo_id: my_dataset}")],
             "dataset.sources.1.repo_id='my_dataset': is not a Hub repo id <user>/<dataset>",
             "dataset.sources.1.repo_id=${HF_USER}/my_dataset"),
    BadInput("mixture_source_repo_id_offline_and_not_cached", [MIXTURE, _sources(PUSHT_01, "{repo_id: me/my_dataset}")],
             "dataset.sources.1.repo_id='me/my_dataset': is not in LeRobot's cache (/nonexistent/lerobot/me/my_dataset), "
             "and HF_HUB_OFFLINE=1 forbids downloading it",
             "fetch it while online: hf download me/my_dataset --repo-type dataset --local-dir "
             "/nonexistent/lerobot/me/my_dataset, or dataset.sources.1.root=<a local copy>",
             env={"HF_HUB_OFFLINE": "1", "HF_LEROBOT_HOME": "/nonexistent/lerobot"}),
    BadInput("mixture_chunk_longer_than_a_sources_shortest_episode",
             [MIXTURE, "policy.chunk_size=200", "policy.n_action_steps=10", TWO_SOURCES],
             "policy.chunk_size=200: each sample loads 200 action frames, more than the shortest episode of "
             "dataset.sources.0 has", "policy.chunk_size=<at most 118>, or dataset.sources.0.episodes=<longer episodes>"),
    BadInput("mixture_source_without_episodes", [MIXTURE, _sources(PUSHT_01, f"{{root: {PUSHT_SLICE}, episodes: []}}")],
             "dataset.sources.1.episodes=[]: selects no episode",
             "dataset.sources.1.episodes=null (all of them), or a list of episode indices"),
    BadInput("mixture_per_source_with_a_simulation_evaluation",
             [MIXTURE, "dataset.stats=per_source", "eval.n_episodes=2", TWO_SOURCES],
             "dataset.stats='per_source': normalises each sample with its own source's statistics, but an evaluation in "
             "simulation runs the policy with the merged ones it never trained with",
             "eval.n_episodes=0 (evaluate the checkpoint with the source's policy_preprocessor_<source>.json), or "
             "dataset.stats=merged"),
    BadInput("mixture_more_ranks_than_samples", [MIXTURE, TWO_SOURCES],
             "dataset.sources=['pusht_image_slice', 'pusht_image_slice_1']: has 420 samples, fewer than the 1000 "
             "data-parallel ranks launched", "launch at most 420 processes, or a larger dataset", world_size=1000),
    # --- episodes named twice, the progress interval ----------------------------------------------------------
    BadInput("episodes_repeated", [*VALID, "dataset.episodes=[0,0]"],
             "dataset.episodes=[0, 0]: names episode [0] more than once (each episode is read once, so a repeat "
             "weighs nothing)", "dataset.episodes=[0], each episode once"),
    BadInput("val_episodes_repeated", [*VALID, "dataset.val_episodes=[2,1,2]"],
             "dataset.val_episodes=[2, 1, 2]: names episode [2] more than once", "dataset.val_episodes=[2,1], each "
             "episode once"),
    BadInput("mixture_source_episodes_repeated",
             [MIXTURE, _sources(PUSHT_01, f"{{root: {PUSHT_SLICE}, episodes: [2, 2]}}")],
             "dataset.sources.1.episodes=[2, 2]: names episode [2] more than once",
             "dataset.sources.1.episodes=[2], each episode once"),
    BadInput("log_every_s_negative", [*VALID, "logging.log_every_s=-5"],
             "logging.log_every_s=-5.0: must be >= 0", "logging.log_every_s=30"),
    # --- a VLA's padded vectors: a wider state or action than the policy pads to (the tiny presets on a 14-joint
    # dataset; pi0.5 never pads its state, which enters the prompt as bins) ------------------------------------------
    BadInput("state_wider_than_max_state_dim",
             ["experiment=aloha_pi0_tiny", "dataset=lerobot", "dataset.root=<tmp>/aloha", "policy.chunk_size=4",
              "policy.n_action_steps=4", "eval.n_episodes=0", "policy.max_state_dim=8"],
             "policy.max_state_dim=8: the dataset's observation.state has 14 dims, more than the 8 the policy pads "
             "it to", "policy.max_state_dim=14", make=_aloha_like_dataset),
    BadInput("action_wider_than_max_action_dim",
             ["experiment=aloha_smolvla_tiny", "dataset=lerobot", "dataset.root=<tmp>/aloha", "policy.chunk_size=4",
              "policy.n_action_steps=4", "eval.n_episodes=0", "policy.max_action_dim=8"],
             "policy.max_action_dim=8: the dataset's action has 14 dims, more than the 8 the policy pads it to",
             "policy.max_action_dim=14", make=_aloha_like_dataset),
]


DP_SHARD_2 = [*VALID, "parallelism.dp_shard=2"]  # on 2 processes
# More of validate's refusals: (id, typed, world size, the message's start, its fix).
VALIDATION_ROWS: list[tuple[str, list[str], int, str, str]] = [
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
    ("torch_threads", [*VALID, "torch_threads=0"], 1, "torch_threads=0: must be >= 1", "torch_threads=1"),
    # the accelerator
    (
        "mixed_precision",
        [*VALID, "accelerator.mixed_precision=fp8"],
        1,
        "accelerator.mixed_precision='fp8': must be one of no, bf16, fp16",
        "accelerator.mixed_precision=no",
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
        [*DP_SHARD_2, "accelerator.fsdp.wrap_modules=[ACTEncoderLayer]", "accelerator.fsdp.min_num_params=1000"],
        2,
        "accelerator.fsdp.min_num_params=1000: cannot be combined with accelerator.fsdp.wrap_modules "
        "(choose one wrap policy)",
        "remove accelerator.fsdp.min_num_params or accelerator.fsdp.wrap_modules",
    ),
    (
        "empty_wrap_modules",
        [*DP_SHARD_2, "accelerator.fsdp.wrap_modules=[]"],
        2,
        "accelerator.fsdp.wrap_modules=[]: names no class: only the root would be wrapped",
        "accelerator.fsdp.wrap_modules='[\"MyBlock\"]'",
    ),
    (
        "min_num_params_below_1",
        [*DP_SHARD_2, "accelerator.fsdp.min_num_params=0"],
        2,
        "accelerator.fsdp.min_num_params=0: must be >= 1",
        "accelerator.fsdp.min_num_params=1000000",
    ),
    (
        "unknown_policy_dtype",
        [*DP_SHARD_2, "accelerator.fsdp.mixed_precision_policy.reduce_dtype=fp32"],
        2,
        "accelerator.fsdp.mixed_precision_policy.reduce_dtype='fp32': must be one of float32, bfloat16, float16",
        "accelerator.fsdp.mixed_precision_policy.reduce_dtype=float32",
    ),
    (
        "float16_without_fp16",
        [*DP_SHARD_2, "accelerator=bf16", "accelerator.fsdp.mixed_precision_policy.param_dtype=float16"],
        2,
        "accelerator.fsdp.mixed_precision_policy.param_dtype='float16': float16 needs the loss scaler, "
        "which only accelerator.mixed_precision=fp16 builds",
        "accelerator.mixed_precision=fp16",
    ),
    (
        "float16_output_without_fp16",
        [*DP_SHARD_2, "accelerator.fsdp.mixed_precision_policy.output_dtype=float16"],
        2,
        "accelerator.fsdp.mixed_precision_policy.output_dtype='float16': float16 needs the loss scaler",
        "accelerator.mixed_precision=fp16",
    ),
    # the checkpoint
    (
        "checkpoint_format",
        [*VALID, "checkpoint.format=pickle"],
        1,
        "checkpoint.format='pickle': must be one of safetensors, dcp, safetensors_dcp",
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
        "dataset.name='hub': must be one of embedded, lerobot",
        "dataset.name=embedded",
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
        "optimizer.type='sgd': must be one of adamw",
        "optimizer.type=adamw",
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
        "scheduler.type='linear': must be one of none, constant, cosine, diffuser_cosine, cosine_decay_with_warmup",
        "scheduler.type=none",
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
        "ema_power",
        [*VALID, "ema.enable=true", "ema.power=0"],
        1,
        "ema.power=0.0: must be > 0",
        "ema.power=0.75",
    ),
    (
        "ema_inv_gamma",
        [*VALID, "ema.inv_gamma=-1"],
        1,
        "ema.inv_gamma=-1.0: must be > 0",
        "ema.inv_gamma=1.0",
    ),
    (
        "ema_max_decay",
        [*VALID, "ema.enable=true", "ema.max_decay=1"],
        1,
        "ema.max_decay=1.0: must be in [0, 1) (1 would never move the average)",
        "ema.max_decay=0.9999",
    ),
    (
        "ema_min_decay_above_max",
        [*VALID, "ema.min_decay=0.5", "ema.max_decay=0.4"],
        1,
        "ema.min_decay=0.5: must be in [0, ema.max_decay=0.4]",
        "ema.min_decay=0.0",
    ),
    (
        "ema_update_after_step",
        [*VALID, "ema.update_after_step=-1"],
        1,
        "ema.update_after_step=-1: must be >= 0",
        "ema.update_after_step=0",
    ),
    (
        "wandb_mode",
        [*VALID, "logging.wandb.mode=cloud"],
        1,
        "logging.wandb.mode='cloud': must be one of offline, online, disabled",
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
        "eval.n_episodes=5: evaluation runs the ALOHA transfer-cube simulation, whose observation.state has shape "
        "[14], and that of dataset.root has shape [2]",
        "eval.n_episodes=0 (dataset.val_episodes evaluates without a simulator), or dataset=embedded",
    ),
    ("eval_freq_negative", [*VALID, "eval.freq=-1"], 1, "eval.freq=-1: must be >= 0", "eval.freq=0"),
    ("eval_max_steps_zero", [*VALID, "eval.max_steps=0"], 1, "eval.max_steps=0: must be >= 1 (or null)",
     "eval.max_steps=null"),
    (
        "eval_inside_an_accumulation_window",
        [*VALID, "steps=12", "eval.freq=6", "dataset.val_episodes=1", "accelerator.gradient_accumulation.steps=4"],
        1,
        "eval.freq=6: is not a multiple of accelerator.gradient_accumulation.steps=4",
        "eval.freq=8",
    ),
    (
        "val_batches_without_validation_episodes",
        [*VALID, "eval.val_batches=4"],
        1,
        "eval.val_batches=4: sizes the validation loss, and dataset.val_episodes holds no episode out",
        "dataset.val_episodes=<episodes or a count>, or drop eval.val_batches",
    ),
    (
        "val_episodes_not_a_count_or_list",
        [*VALID, "dataset.val_episodes=0"],
        1,
        "dataset.val_episodes=0: must be a non-empty list of episode indices, or a count >= 1",
        "dataset.val_episodes=5",
    ),
    (
        "val_episodes_overlapping_the_training_episodes",
        [*VALID, "dataset.episodes=[0,1]", "dataset.val_episodes=[1,2]"],
        1,
        "dataset.val_episodes=[1, 2]: holds out episodes [1], which dataset.episodes trains on",
        "dataset.val_episodes=<episodes outside dataset.episodes>",
    ),
    (
        "val_episodes_leaving_nothing_to_train_on",
        [*VALID, "dataset.val_episodes=3"],
        1,
        "dataset.val_episodes=3: holds out every episode of dataset.root (it has 3): nothing is left to train on",
        "dataset.val_episodes=<at most 2>",
    ),
    (
        "val_episodes_unknown",
        [*VALID, "dataset.val_episodes=[7]"],
        1,
        "dataset.val_episodes=[7]: dataset.root has no episode [7] (it has 3: 0..2)",
        "dataset.val_episodes=<indices in 0..2>, or a count",
    ),
    ("keep_best_zero", [*VALID, "checkpoint.keep_best=0"], 1, "checkpoint.keep_best=0: must be >= 1 (or null)",
     "checkpoint.keep_best=1"),
    (
        "keep_best_without_evaluation_steps",
        [*VALID, "checkpoint.keep_best=2", "dataset.val_episodes=1"],
        1,
        "checkpoint.keep_best=2: ranks the checkpoints of evaluation steps, and this run evaluates only at its last "
        "step (eval.freq=0)",
        "eval.freq=<loop steps> with checkpoint.save_checkpoint=true, or checkpoint.keep_best=null",
    ),
    (
        "best_metric_without_keep_best",
        [*VALID, "checkpoint.best_metric=val_loss"],
        1,
        "checkpoint.best_metric='val_loss': only ranks checkpoints for checkpoint.keep_best, which is not set",
        "checkpoint.keep_best=1, or drop checkpoint.best_metric",
    ),
    (
        "best_metric_success_rate_without_simulation",
        [*VALID, "checkpoint.keep_best=1", "eval.freq=10", "dataset.val_episodes=1",
         "checkpoint.best_metric=success_rate"],
        1,
        "checkpoint.best_metric='success_rate': ranks by the success rate in simulation, and eval.n_episodes=0 runs "
        "none",
        "eval.n_episodes=50, or checkpoint.best_metric=val_loss",
    ),
    (
        "best_metric_val_loss_without_validation_episodes",
        [*VALID, "checkpoint.keep_best=1", "eval.freq=10", "eval.n_episodes=5", "checkpoint.best_metric=val_loss"],
        1,
        "checkpoint.best_metric='val_loss': ranks by the validation loss, and no dataset.val_episodes are held out",
        "dataset.val_episodes=<episodes or a count>, or checkpoint.best_metric=success_rate",
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
        "config_path_without_resume",
        [*VALID, f"config_path={PUSHT_SLICE / 'meta' / 'info.json'}"],
        1,
        f"config_path='{PUSHT_SLICE / 'meta' / 'info.json'}': is only read when resuming",
        "resume=true, or remove config_path",
    ),
    (
        "decay_steps_below_1",
        [*VALID, "scheduler=cosine_decay_with_warmup", "scheduler.num_decay_steps=0"],
        1,
        "scheduler.num_decay_steps=0: must be >= 1",
        "scheduler.num_decay_steps=30000",
    ),
    (
        "param_group_lr_not_positive",
        [*VALID, "optimizer.param_groups=[{match:model.backbone.,lr:0}]"],
        1,
        "optimizer.param_groups[0].lr=0.0: must be > 0 (null: optimizer.lr)",
        "'optimizer.param_groups=[{match:model.backbone.,lr:1e-5}]', or optimizer.param_groups=[]",
    ),
]
_IDS = {row.id for row in CATALOGUE}
CATALOGUE += [BadInput(row_id, typed, start, fix, world_size) for row_id, typed, world_size, start, fix in VALIDATION_ROWS
              if row_id not in _IDS]


def _run_config(typed: list[str], world_size: int):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=typed)
    if composed.resume:
        composed = merge_resume_config(composed, typed)
    return run_config(composed, frozenset(override_keys(typed)))


def _refusal(row: BadInput, tmp: Path) -> str:
    """The launch's checks in scripts/train.py's order, up to the first refusal; its message."""
    if row.make is not None:
        row.make(tmp)
    typed = [arg.replace("<tmp>", str(tmp)) for arg in row.typed]
    with pytest.raises(ConfigError) as error:
        check_presets(typed)
        check_choices(typed)
        cfg = _run_config(typed, row.world_size)
        preflight(cfg, row.world_size, env=row.env)
    assert not torch.distributed.is_initialized()  # refused before any process group
    return str(error.value).replace(str(tmp), "<tmp>")


def test_the_catalogue_has_the_rows_the_docs_list() -> None:
    assert len(CATALOGUE) >= 30
    assert len({row.id for row in CATALOGUE}) == len(CATALOGUE)
    table = ERRORS_DOC.read_text()
    missing = [row_id for row_id in [row.id for row in CATALOGUE] + [row[0] for row in COMMAND_ROWS]
               if f"`{row_id}`" not in table]
    assert not missing, f"docs/errors.md has no row for {missing}"


# Rows whose refusal comes after the check for the sim extra (without it, that check refuses first).
SIM_ROWS = {"eval_on_non_embedded_dataset"}


@pytest.mark.parametrize("row", [pytest.param(row, marks=pytest.mark.sim) if row.id in SIM_ROWS else row
                                 for row in CATALOGUE], ids=[row.id for row in CATALOGUE])
def test_bad_input_is_refused_with_the_key_the_value_and_the_fix(row: BadInput, tmp_path: Path) -> None:
    message = _refusal(row, tmp_path)
    assert "\n" not in message
    assert message.startswith(row.start), message
    assert message.split(". Fix: ", 1)[1].startswith(row.fix), message


# A GPU that cannot compute in the precision asked for: no such GPU here, so torch's answers about the device are
# replaced by those of the GPUs named (what torch.cuda reports on them); the rule under test is ours.
GPUS = {"Tesla K80": (3, 7), "Tesla V100-SXM2-16GB": (7, 0)}
PRECISION_ROWS = [  # (id, GPU, accelerator.mixed_precision, message start, fix)
    ("fp16_where_the_gpu_cannot", "Tesla K80", "fp16",
     "accelerator.mixed_precision='fp16': Tesla K80 (compute capability 3.7) has no fp16 arithmetic",
     "accelerator.mixed_precision=no"),
    ("bf16_where_the_gpu_cannot", "Tesla V100-SXM2-16GB", "bf16",
     "accelerator.mixed_precision='bf16': Tesla V100-SXM2-16GB (compute capability 7.0) has no native bf16",
     "accelerator.mixed_precision=fp16"),
]


@pytest.mark.parametrize(("row_id", "gpu", "precision", "start", "fix"), PRECISION_ROWS,
                         ids=[row[0] for row in PRECISION_ROWS])
def test_a_precision_the_gpu_cannot_compute_is_refused(row_id: str, gpu: str, precision: str, start: str, fix: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _run_config([*VALID, f"accelerator.mixed_precision={precision}"], 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: GPUS[gpu])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: GPUS[gpu] >= (8, 0))
    with pytest.raises(ConfigError) as error:
        preflight(cfg, 1)
    message = str(error.value)
    assert message.startswith(start) and message.split(". Fix: ", 1)[1].startswith(fix), message
    assert f"`{row_id}`" in ERRORS_DOC.read_text()
    # The same GPU with the precision the fix names passes this check (negative control of the rule).
    assert precision_unsupported(fix.split("=")[1], use_cpu=False) is None


@pytest.mark.sim  # one package hidden: the message names it alone where the others are installed
def test_evaluation_without_the_sim_extra_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine where `pip install lerobot_mg` left out the `sim` extra: its packages are not found."""
    cfg = _run_config([*VALID, "eval.n_episodes=5", "eval.freq=10"], 1)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mujoco" else find_spec(name, *a))
    with pytest.raises(ConfigError) as error:
        preflight(cfg, 1)
    message = str(error.value)
    assert message.startswith("eval.n_episodes=5: evaluation in simulation needs the sim extra, and ['mujoco'] are "
                              "not installed. Fix: pip install 'lerobot_mg[sim]'"), message
    assert "`eval_without_the_sim_extra`" in ERRORS_DOC.read_text()


def test_defaults_the_user_did_not_type_never_refuse_a_short_run() -> None:
    """The cosine preset's 100 warm-up steps on a 100-step or an 8-step run: scaled down, not refused."""
    for steps, warmup in ((100, 10), (8, 0)):
        cfg = _run_config([*VALID, "scheduler=cosine", f"steps={steps}"], 1)
        assert cfg.scheduler.num_warmup_steps == warmup
        preflight(cfg, 1)
    # A long run keeps the preset's warm-up, and a typed one is kept as typed.
    assert _run_config([*VALID, "scheduler=cosine", "steps=2000"], 1).scheduler.num_warmup_steps == 100
    assert _run_config([*VALID, "scheduler=cosine", "steps=100", "scheduler.num_warmup_steps=50"],
                       1).scheduler.num_warmup_steps == 50


# --- through the real command: exit status 2, one line, no traceback --------------------------------------------

def _accelerate_launch(*options: str) -> list[str]:
    return [PYTHON, "-m", "accelerate.commands.launch", *options, f"--main_process_port={free_port()}",
            str(TRAIN_SCRIPT)]


# (id, command before the overrides, extra overrides, environment, files to write: name -> text). Four rows through
# scripts/train.py itself (a refusal by validate, a preset name and a wrong word refused before Hydra composes, a
# dataset mixture's weight refused by the dataset checks), and the two sources of accelerate variables that only exist
# under `accelerate launch`: its config file and its default config.
COMMAND_ROWS = [
    ("steps_negative", [PYTHON, str(TRAIN_SCRIPT)], ["steps=-100"], {}, {}),
    ("unknown_experiment", [PYTHON, str(TRAIN_SCRIPT)], ["experiment=pusht_debg"], {}, {}),
    ("format_in_the_wrong_case", [PYTHON, str(TRAIN_SCRIPT)], ["checkpoint.format=DCP"], {}, {}),
    ("accelerate_config_file", _accelerate_launch("--config_file", "<tmp>/accelerate.yaml"), [], {},
     {"accelerate.yaml": ACCELERATE_CONFIG}),
    ("accelerate_default_config", _accelerate_launch(), [], {"HF_HOME": "<tmp>/hf"},
     {"hf/accelerate/default_config.yaml": ACCELERATE_CONFIG}),
    # A mixture typed as the list override a user types (one argument), the debug run's dataset.root dropped.
    ("mixture_weight_negative", [PYTHON, str(TRAIN_SCRIPT)],
     [MIXTURE, "dataset.root=null", _sources(f"{{root: {PUSHT_SLICE}, weight: 0.7}}",
                                             f"{{root: {PUSHT_SLICE}, episodes: [2], weight: -0.3}}")], {}, {}),
]
# The start of the one line each prints (the message after "lerobot-mg-train: error: ").
COMMAND_LINES = {
    "steps_negative": "steps=-100: must be >= 1",
    "unknown_experiment": "experiment='pusht_debg': is not a preset in conf/experiment/",
    "format_in_the_wrong_case": "checkpoint.format='DCP': must be one of safetensors, dcp, safetensors_dcp. Fix: "
                                "checkpoint.format=dcp",
    "accelerate_config_file": "ACCELERATE_MIXED_PRECISION=bf16 ACCELERATE_USE_CPU=True: accelerate configuration",
    "accelerate_default_config": "ACCELERATE_MIXED_PRECISION=bf16 ACCELERATE_USE_CPU=True: accelerate configuration",
    "mixture_weight_negative": "dataset.sources.1.weight=-0.3: must be a finite number >= 0. Fix: "
                               "dataset.sources.1.weight=<a probability, e.g. 0.5>",
}


def test_the_command_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    """All rows start at once (they only import and refuse), each under a watchdog."""
    procs = {}
    for row_id, command, overrides, env, files in COMMAND_ROWS:
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        output_dir = tmp_path / f"out_{row_id}"
        argv = [arg.replace("<tmp>", str(tmp_path)) for arg in
                [*command, *VALID, "steps=2", *overrides, f"output_dir={output_dir}"]]
        run_env = clean_env({key: value.replace("<tmp>", str(tmp_path)) for key, value in env.items()})
        del run_env["HYDRA_FULL_ERROR"]  # what a user sees: the one line, not the test suite's tracebacks
        procs[row_id] = subprocess.Popen(argv, env=run_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
    for row_id, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise AssertionError(f"watchdog: {row_id} ran over 240 s") from None
        # Our one line is the line that starts with the prefix: accelerate (1.16 and newer) may repeat the child's
        # last line inside its own RuntimeError, which is accelerate's output, not ours.
        errors = [line for line in stderr.splitlines() if line.startswith("lerobot-mg-train: error:")]
        if row_id.startswith("accelerate"):
            # accelerate's launcher re-raises the script's exit status 2 as its own CalledProcessError (exit 1,
            # accelerate's traceback); the script itself printed its one line without one.
            assert proc.returncode == 1 and "returned non-zero exit status 2." in stderr, f"{row_id}:\n{stderr[-3000:]}"
            # No frame of our package (or our scripts) in accelerate's traceback: the repository's own folder may
            # be called lerobot_mg too (CI's clone), so compare against where the package and scripts really are.
            ours = (str(REPO / "lerobot_mg"), str(REPO / "scripts"))
            frames = [line for line in stderr.splitlines() if line.startswith("  File")]
            assert not [frame for frame in frames if any(place in frame for place in ours)], f"{row_id}:\n{stderr}"
        else:
            assert proc.returncode == 2, f"{row_id}: exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}"
            assert "Traceback" not in stderr + stdout, f"{row_id}:\n{stderr[-3000:]}"
        assert len(errors) == 1, f"{row_id}:\n{stderr[-3000:]}"
        line = errors[0].split("lerobot-mg-train: error: ", 1)[1].replace(str(tmp_path), "<tmp>")
        assert line.startswith(COMMAND_LINES[row_id]) and ". Fix: " in line, f"{row_id}: {line}"
        assert not (tmp_path / f"out_{row_id}").exists()  # nothing was set up
