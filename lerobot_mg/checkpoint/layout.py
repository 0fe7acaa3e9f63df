"""Checkpoint file names, exactly the guide's tree.

```
checkpoints/005000/pretrained_model/{config.json, train_config.json, model.safetensors | pytorch_model_fsdp_0/,
                                     policy_preprocessor*.json/.safetensors, policy_postprocessor*}
    (a PEFT run: adapter_model.safetensors + adapter_config.json replace model.safetensors; the DCP shards
     hold the adapter only)
checkpoints/005000/pretrained_model_ema/{the same files, with the averaged weights}      (ema.enable=true)
checkpoints/005000/training_state/{optimizer_param_groups.json, optimizer_state.safetensors | optimizer_0/,
                                   rng_state.safetensors, scheduler_state.json, scaler_state.json,
                                   ema_state.json, training_step.json, eval_metrics.json (with keep_best)}
checkpoints/last -> 005000
checkpoints/best -> 004000   (checkpoint.keep_best: the best evaluated checkpoint)
```
A step directory only ever appears complete: it is written as ``.tmp-005000`` and renamed once
``training_step.json`` (written last) is on disk; ``last`` moves after that. A step saved again (after a resume
from an older checkpoint) keeps its earlier copy as ``.replaced-005000`` until the new one is in place; a start that
finds that name puts the earlier copy back if the new one never arrived.

``last`` and ``best`` are symlinks. A copy that turned them into real directories (``rsync -L``, an object-store
sync, a Hub download) still resumes; the first save after that moves such a directory aside, never deleting it: to
``<its step>`` when no checkpoint has that name (it is then one checkpoint among the others), else to
``last.copy-<its step>`` (nothing deletes that one; remove it once you no longer need it).
"""

from __future__ import annotations

from pathlib import Path

from lerobot_mg.errors import ConfigError

CHECKPOINTS_DIR = "checkpoints"
LAST_LINK = "last"
BEST_LINK = "best"
PRETRAINED_MODEL_DIR = "pretrained_model"
PRETRAINED_MODEL_EMA_DIR = "pretrained_model_ema"  # LeRobot's name for the EMA weights (ema.enable=true)
TRAINING_STATE_DIR = "training_state"
TMP_PREFIX = ".tmp-"  # a save being written: a start deletes it
REPLACED_PREFIX = ".replaced-"  # the earlier copy of a step being saved again: a start puts it back or deletes it
COPY_INFIX = ".copy-"  # a real directory that stood where the link `last` or `best` goes: <link>.copy-<step>

TRAIN_CONFIG_JSON = "train_config.json"
MODEL_SAFETENSORS = "model.safetensors"
MODEL_DCP_DIR = "pytorch_model_fsdp_0"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_CONFIG_JSON = "adapter_config.json"  # records the base model's path (base_model_name_or_path)

OPTIMIZER_PARAM_GROUPS = "optimizer_param_groups.json"
OPTIMIZER_STATE = "optimizer_state.safetensors"
OPTIMIZER_DCP_DIR = "optimizer_0"
RNG_STATE = "rng_state.safetensors"
SCHEDULER_STATE = "scheduler_state.json"
SCALER_STATE = "scaler_state.json"
EMA_STATE = "ema_state.json"  # the EMA's update count and last decay
TRAINING_STEP = "training_step.json"
EVAL_METRICS = "eval_metrics.json"  # the evaluation of the checkpoint's weights at its step (checkpoint.keep_best)


def step_dir_name(step: int) -> str:
    return f"{step:06d}"


def weights_dir(pretrained_dir: Path, use_ema: bool) -> Path:
    """The weights to evaluate for a checkpoint's ``pretrained_model/``: its ``pretrained_model_ema/`` sibling when
    ``use_ema`` and the checkpoint has one, else ``pretrained_dir`` itself."""
    pretrained_dir = Path(pretrained_dir)
    ema = pretrained_dir.parent / PRETRAINED_MODEL_EMA_DIR
    return ema if use_ema and pretrained_dir.name == PRETRAINED_MODEL_DIR and ema.is_dir() else pretrained_dir


def checkpoints_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def checkpoint_dir_from_config_path(config_path: Path) -> Path:
    """``.../checkpoints/last/pretrained_model/train_config.json`` -> the (resolved) step directory."""
    config_path = Path(config_path)
    if config_path.name != TRAIN_CONFIG_JSON or config_path.parent.name != PRETRAINED_MODEL_DIR:
        raise ConfigError(
            f"config_path={str(config_path)!r}: expected <run>/checkpoints/<step or last>/pretrained_model/"
            f"{TRAIN_CONFIG_JSON}. Fix: config_path=<run>/checkpoints/last/pretrained_model/{TRAIN_CONFIG_JSON}"
        )
    return config_path.parent.parent.resolve()


def run_dir_from_checkpoint(step_dir: Path) -> Path:
    return Path(step_dir).resolve().parent.parent


def complete_step_dirs(output_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    dirs = [
        d for d in root.iterdir()
        if d.is_dir() and not d.is_symlink() and d.name.isdigit() and (d / TRAINING_STATE_DIR / TRAINING_STEP).is_file()
    ]
    return sorted(dirs, key=lambda d: int(d.name))
