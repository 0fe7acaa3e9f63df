"""One run directory per run, identical on every rank.

Hydra under torchrun composes a directory per rank from the clock: ranks that start in different seconds
disagree, and two runs in the same second collide. The main process picks the name (time + a random suffix)
and broadcasts it.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import torch.distributed as dist


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
