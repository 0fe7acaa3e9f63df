"""training_step.json, a checkpoint's completion marker: what it holds, its writing and its reading at a resume.

A save writes it last, once every other file of the checkpoint is on disk (:class:`CheckpointManager` calls
:func:`write_training_step`); a resume reads it first and checks the files beside it
(:func:`resume_point`, before any process group exists). It holds where the loop is (step, progress, the data
sampler's position) and the facts of the start that wrote it (batch arithmetic, topology, revisions...).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.integrity import check_checkpoint_files, earlier_checkpoint_fix
from lerobot_mg.checkpoint.state import read_json, write_json
from lerobot_mg.errors import ConfigError
from lerobot_mg.run_facts import Progress, RunFacts, from_dict

# training_step.json's keys that a resume reads; "progress" must also hold every Progress field.
TRAINING_STEP_KEYS = ("step", "progress", "sampler", "facts")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes and what its training_step.json says."""

    step_dir: Path
    progress: Progress
    sampler_state: dict[str, int]
    facts: RunFacts  # the facts of the start that wrote the checkpoint


def training_step(progress: Progress, sampler_state: dict[str, int], facts: RunFacts) -> dict[str, Any]:
    """training_step.json's contents: where the loop is, and the facts it ran under."""
    return {"step": progress.step, "progress": asdict(progress), "sampler": sampler_state, "facts": asdict(facts)}


def write_training_step(training_state: Path, contents: dict[str, Any]) -> None:
    """Write the marker into a save's ``training_state/`` (whole, or not at all)."""
    write_json(training_state / L.TRAINING_STEP, contents)


def check_resumable(step_dir: Path) -> dict[str, Any]:
    """Raise ``ConfigError`` (naming the file and the remedy) if this code cannot resume ``step_dir``: a missing,
    truncated or incomplete file. Reads headers and sizes only.

    Runs before any process group exists; returns training_step.json.
    """
    earlier = earlier_checkpoint_fix(step_dir)
    marker = step_dir / L.TRAINING_STATE_DIR / L.TRAINING_STEP
    if not marker.is_file():
        raise ConfigError(
            f"{marker} is missing: {step_dir} is not a complete checkpoint (a save was interrupted). "
            f"Fix: resume from config_path={step_dir.parent / L.LAST_LINK / L.PRETRAINED_MODEL_DIR / L.TRAIN_CONFIG_JSON}, "
            "which always names the last complete checkpoint"
        )
    try:
        info = read_json(marker)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{marker} is not valid JSON ({error}). Fix: {earlier}") from error
    if "facts" not in info:
        raise ConfigError(f"{marker} holds no run facts: the checkpoint was written by an older lerobot_mg. Fix: "
                          "resume it with that version, or start a new run from its weights")
    missing_keys = [key for key in TRAINING_STEP_KEYS if key not in info]
    missing_keys += [f"progress.{f.name}" for f in fields(Progress)
                     if isinstance(info.get("progress"), dict) and f.name not in info["progress"]]
    if missing_keys:
        raise ConfigError(f"{marker} lacks the key(s) {missing_keys} a resume reads. Fix: {earlier}")
    check_checkpoint_files(step_dir, saved_sharded=info["facts"]["topology"]["dp_shard"] > 1)
    return info


def resume_point(config_path: Path | str, steps: int) -> ResumePoint:
    """The checkpoint ``config_path`` (``<run>/checkpoints/<step or last>/pretrained_model/train_config.json``)
    names, checked whole and short of ``steps`` (the loop steps the resumed run goes to)."""
    step_dir = L.checkpoint_dir_from_config_path(Path(config_path))
    saved = check_resumable(step_dir)
    if saved["step"] >= steps:
        raise ConfigError(f"steps={steps!r}: the checkpoint to resume is already at loop step {saved['step']}. "
                          f"Fix: steps=<more than {saved['step']}>")
    return ResumePoint(step_dir, Progress(**saved["progress"]), saved["sampler"], from_dict(RunFacts, saved["facts"]))
