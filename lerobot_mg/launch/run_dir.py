"""One run directory per run, identical on every rank, and the configs written into it.

Hydra under torchrun composes a directory per rank from the clock: ranks that start in different seconds
disagree, and two runs in the same second collide. The main process picks the name (time + a random suffix)
and broadcasts it.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from lerobot_mg.checkpoint import layout
from lerobot_mg.checkpoint.resume import ResumePoint
from lerobot_mg.checkpoint.state import write_json
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.launch.sweep import SweepJob


def new_run_dir_name(job_name: str) -> Path:
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    return Path("outputs/train") / f"{stamp}_{job_name}_{secrets.token_hex(3)}"


def agree_on_output_dir(requested: str | None, job_name: str, is_main: bool, is_distributed: bool) -> Path:
    """The run directory: ``requested`` if given, else one named by the main process; the main process's choice
    either way (ranks of a local sweep under torchrun compose sweep directories from their own clocks).
    Collective when distributed: every rank must call it."""
    chosen = [str(Path(requested).absolute()) if requested else (str(new_run_dir_name(job_name).absolute())
                                                                  if is_main else None)]
    if is_distributed:
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])  # type: ignore[arg-type]


def run_dir(cfg: TrainConfig, resume: ResumePoint | None, sweep_job: SweepJob | None, dims: ParallelDims) -> Path:
    """The resumed run's directory, the sweep job's, output_dir, or a new one named by the main process.
    Collective when distributed and none is given."""
    if resume is not None:
        return layout.run_dir_from_checkpoint(resume.step_dir)
    requested = str(sweep_job.run_dir) if sweep_job is not None else cfg.output_dir
    return agree_on_output_dir(requested, cfg.job_name, dims.is_main_process, dims.is_distributed)


def save_run_configs(output_dir: Path, train_config: dict, composed: DictConfig | None, resumed: bool) -> None:
    """The composed (with interpolations) and the resolved config, once per run (a resume keeps the originals;
    each checkpoint carries the config it was saved under)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if resumed and (output_dir / layout.TRAIN_CONFIG_JSON).exists():
        return
    write_json(output_dir / layout.TRAIN_CONFIG_JSON, train_config)
    if composed is not None:
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(composed, resolve=False))
