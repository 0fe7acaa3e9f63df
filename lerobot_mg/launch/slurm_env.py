"""One SLURM task -> the torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

submitit starts ``nodes x tasks_per_node`` tasks through srun and sets no torch.distributed variable; every task
must export them before anything touches torch.distributed. The facts come from the srun step:

- rank = ``SLURM_PROCID``, world size = ``SLURM_STEP_NUM_TASKS``, local rank = ``SLURM_LOCALID``;
- MASTER_ADDR = the step's first node, MASTER_PORT derived from ``SLURM_JOB_ID``: the same after a requeue (the
  job id survives it), different for jobs running side by side (a random port races);
- GPUs from ``SLURM_GPUS_ON_NODE`` (``SLURM_GPUS_PER_NODE`` can read ``a100:4``); a task without GPUs sees none.

A launcher that set RANK and WORLD_SIZE itself (torchrun inside an allocation) is left alone: ``SLURM_PROCID``
is set there too, but SLURM did not spawn those ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import MutableMapping
from dataclasses import dataclass

from lerobot_mg.errors import ConfigError

# Ports below Linux's ephemeral range (32768+), so an outgoing connection never holds a job's port.
MASTER_PORT_BASE = 20_000
MASTER_PORT_SPAN = 12_000


@dataclass(frozen=True)
class SlurmTask:
    job_id: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    gpus_on_node: int

    @property
    def master_port(self) -> int:
        # Consecutive job ids get distinct ports: two jobs collide only if their ids differ by a multiple of the span.
        return MASTER_PORT_BASE + self.job_id % MASTER_PORT_SPAN

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str]) -> SlurmTask | None:
        """The task of an srun step, or None outside one (a batch script's own shell has no SLURM_STEP_ID)."""
        if "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
            return None
        node_rank = int(environ["SLURM_NODEID"])
        return cls(
            job_id=int(environ["SLURM_JOB_ID"]),
            rank=int(environ["SLURM_PROCID"]),
            world_size=int(environ["SLURM_STEP_NUM_TASKS"]),
            local_rank=int(environ["SLURM_LOCALID"]),
            local_world_size=expand_task_counts(environ["SLURM_STEP_TASKS_PER_NODE"])[node_rank],
            node_rank=node_rank,
            num_nodes=int(environ["SLURM_STEP_NUM_NODES"]),
            master_addr=first_host(environ["SLURM_STEP_NODELIST"]),
            gpus_on_node=int(environ.get("SLURM_GPUS_ON_NODE") or 0),
        )

    def torch_environ(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def expand_task_counts(tasks_per_node: str) -> list[int]:
    """SLURM's compressed per-node counts, e.g. ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"cannot read a SLURM task count list: {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``n[1-2]`` -> ``n1``), expanded by SLURM itself."""
    if "[" not in nodelist and "," not in nodelist:
        return nodelist
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True,
                           timeout=60).stdout.split()
    return hosts[0]


def export_torch_distributed_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Export this SLURM task's torch.distributed variables (nothing where this is not an srun task, or the
    ranks' own launcher already set them). Call before anything touches torch.distributed."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return
    task = SlurmTask.from_environ(environ)
    if task is None:
        return
    if task.gpus_on_node == 0:
        environ["CUDA_VISIBLE_DEVICES"] = ""  # no GPU allocated on this node: use none, whatever the node has
    elif task.local_world_size > task.gpus_on_node:
        raise ConfigError(
            f"{task.local_world_size} tasks share the {task.gpus_on_node} GPU(s) SLURM allocated on this node; one "
            "task per GPU. Fix: hydra.launcher.tasks_per_node=<GPUs per node> (or srun --ntasks-per-node=<GPUs>)"
        )
    environ.update(task.torch_environ())
