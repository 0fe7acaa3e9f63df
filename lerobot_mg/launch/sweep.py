"""One point of a Hydra multirun (``-m``), locally or as a SLURM job: its run directory, resume and tracker group.

The run directory is Hydra's job directory, ``<hydra.sweep.dir>/<job number>``: the sweep directory is resolved
once, in the process that launched the sweep, and travels inside the submission, so every rank of a SLURM job
and every requeue of it name the same directory, and no two points share one. A requeued job restarts with the
arguments it was first submitted with, so a resume point baked in at submission would be stale: instead, a job
whose directory already holds ``checkpoints/last`` resumes from it, and the ledger records why
(:func:`lerobot_mg.launch.preemption.resume_cause`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from lerobot_mg.checkpoint import layout
from lerobot_mg.checkpoint.state import read_json
from lerobot_mg.errors import config_error
from lerobot_mg.launch.preemption import resume_cause
from lerobot_mg.run_facts import ResumeCause


@dataclass(frozen=True)
class SweepJob:
    run_dir: Path  # <hydra.sweep.dir>/<job number>, absolute
    resume_cause: ResumeCause | None  # set when the directory already held a checkpoint to resume


def check_sweep_point(output_dir: str | None, resume: bool) -> None:
    """A point of a Hydra multirun gets its own run directory, <sweep dir>/<job number>, and resumes it by itself."""
    if output_dir is not None:
        raise config_error(
            "output_dir", output_dir,
            "is set in a sweep (-m): every point would write into it; each point runs in <hydra.sweep.dir>/<job number>",
            "remove output_dir, and choose where the sweep goes with hydra.sweep.dir=<dir>",
        )
    if resume:
        raise config_error(
            "resume", True,
            "in a sweep (-m) every point would continue the same run; a sweep job resumes its own directory by itself",
            "resume one run at a time, without -m",
        )


def last_checkpoint_step(run_dir: Path) -> int | None:
    """The loop step of ``checkpoints/last`` (always a complete checkpoint), or None if there is none."""
    marker = layout.checkpoints_root(run_dir) / layout.LAST_LINK / layout.TRAINING_STATE_DIR / layout.TRAINING_STEP
    return int(read_json(marker)["step"]) if marker.is_file() else None


def prepare_sweep_job(composed: DictConfig, hydra_cfg: DictConfig) -> tuple[DictConfig, SweepJob | None]:
    """For a multirun job: the config to train (resuming the job's own checkpoint if it has one) and its
    :class:`SweepJob`; outside a multirun, the config unchanged and None."""
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return composed, None
    check_sweep_point(composed.output_dir, composed.resume)
    run_dir = Path(hydra_cfg.runtime.output_dir).absolute()
    step = last_checkpoint_step(run_dir)
    with open_dict(composed):
        if composed.logging.wandb.group is None:
            composed.logging.wandb.group = str(hydra_cfg.sweep.dir)
        if composed.trackio.group is None:
            composed.trackio.group = str(hydra_cfg.sweep.dir)
        if step is not None:
            # The job's config is composed from the same overrides as the first attempt's: only the resume is new.
            composed.resume = True
            composed.config_path = str(layout.checkpoints_root(run_dir) / layout.LAST_LINK / layout.PRETRAINED_MODEL_DIR
                                       / layout.TRAIN_CONFIG_JSON)
    return composed, SweepJob(run_dir, resume_cause(run_dir, step) if step is not None else None)
