"""Hydra's submitit SLURM launcher, with what multi-node training needs around it.

``hydra/launcher=slurm`` (conf/hydra/launcher/slurm.yaml) selects :class:`SlurmSweepLauncher`: one SLURM job
per sweep point, ``nodes x tasks_per_node`` ranks per job, each rank running the same ``train(cfg)``. On top of
hydra-submitit-launcher it:

- checks every point before anything is queued: its config, and ``dp_replicate x dp_shard`` against
  ``nodes x tasks_per_node`` (:func:`check_slurm_job`), with the one-line user error;
- exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in every task before the task function runs
  (:mod:`lerobot_mg.launch.slurm_env`);
- makes a task whose training failed exit non-zero, so SLURM records the job as FAILED (Hydra would otherwise
  catch the exception and return normally);
- waits for the jobs on ``squeue`` as well as on submitit's result files: submitit learns that a job ended only
  from ``sacct``, which clusters without accounting (the local test cluster) lack, so a job whose rank was killed
  (and wrote no result) would be waited on forever.

Hydra only instantiates launcher classes defined under ``hydra_plugins.*``: lerobot_mg/launch/plugins holds
``hydra_plugins.lerobot_mg_launcher`` (installed into that namespace package), which subclasses this one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

from lerobot_mg.config.loading import override_keys, run_config
from lerobot_mg.distributed.parallel_dims import resolve_dp_degrees
from lerobot_mg.errors import ConfigError, config_error, report_user_error
from lerobot_mg.launch.preemption import LAUNCH_COMMAND_ENV
from lerobot_mg.launch.slurm_env import export_torch_distributed_env
from lerobot_mg.launch.sweep import check_sweep_point
from lerobot_mg.peft.base import apply_policy_path
from lerobot_mg.preflight import preflight

logger = logging.getLogger(__name__)

# A job in one of these states may still write results; any other state (or a job SLURM no longer lists) has ended.
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
    "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED",
})
POLL_INTERVAL_S = 1.0
# After SLURM says a job ended, how long its result files may take to appear on this host (a shared filesystem can
# lag): long for a job that completed (every task wrote one), short for one that failed (a dead task never will).
# PREEMPTED is final (a cluster whose PreemptMode cancels); a requeued job shows REQUEUED/PENDING instead: the long
# wait only guards against a state seen on its way to those.
RESULT_GRACE_S = {"COMPLETED": 60.0, "PREEMPTED": 60.0}
FAILED_RESULT_GRACE_S = 5.0


@dataclass
class SlurmLauncherConf(SlurmQueueConf):
    """hydra-submitit-launcher's SLURM fields, plus ``srun_args`` (submitit's, which that schema lacks)."""

    _target_: str = "hydra_plugins.lerobot_mg_launcher.LerobotSlurmLauncher"
    srun_args: list[str] | None = None  # extra arguments of the srun that starts the ranks


class SlurmSweepLauncher(SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))  # resolved (and cached in the config) once, here
        self._check_points(job_overrides, initial_job_idx)

        params = dict(self.params)
        executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                         slurm_max_num_timeout=params.pop("max_num_timeout"))
        base_keys = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base_keys else f"slurm_{k}": v for k, v in params.items()})
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self.launch_command = list(sys.orig_argv)  # travels with the submission: a job stopped by SIGTERM prints it
        logger.info("SLURM sweep: %d job(s) in %s", len(job_overrides), sweep_dir)
        arguments = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            logger.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            arguments.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*arguments))
        return wait_for_jobs(jobs, [list(o) for o in job_overrides])

    def _check_points(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> None:
        """Every point's config against the job's ranks, before submission. A user error exits with status 2."""
        assert self.hydra_context is not None and self.config is not None
        params = self.params
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            point = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(point):
                del point["hydra"]
            try:
                check_sweep_point(point.output_dir, point.resume)
                if point.policy.path is not None:  # as the job itself will compose it (scripts_entry)
                    point = apply_policy_path(point, list(overrides))
                cfg = run_config(point, frozenset(override_keys(list(overrides))))
                world_size = check_slurm_job(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, params["nodes"],
                                             params["tasks_per_node"], params["gpus_per_node"])
                preflight(cfg, world_size, launched=True, on_this_machine=False)  # the dataset, policy and plan checks too
            except ConfigError as error:
                report_user_error(ConfigError(f"sweep job #{idx} ({' '.join(overrides)}): {error}"))
                raise SystemExit(2) from None

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """One SLURM task: runs in every rank of the job (and again after a requeue)."""
        export_torch_distributed_env()  # before anything touches torch.distributed
        if getattr(self, "launch_command", None):
            os.environ[LAUNCH_COMMAND_ENV] = json.dumps(self.launch_command)
        job_return = super().__call__(*args, **kwargs)
        if job_return.status == JobStatus.FAILED:
            raise job_return._return_value  # exit non-zero: SLURM marks the job FAILED; submitit keeps the traceback
        return job_return


def slurm_states(job_ids: Sequence[str]) -> dict[str, str]:
    """State of each job SLURM still lists (array tasks one per line), from squeue."""
    arrays = sorted({job_id.split("_")[0] for job_id in job_ids})
    out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i %T", "-j", ",".join(arrays)],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:  # "Invalid job id": SLURM forgot every one of them (MinJobAge passed)
        return {}
    return dict(line.split() for line in out.stdout.splitlines() if line.strip())


def _has_all_results(job: Any) -> bool:
    return all(job.task(i).paths.result_pickle.exists() for i in range(job.num_tasks))


def _failed(overrides: list[str], error: BaseException) -> JobReturn:
    job_return = JobReturn(overrides=overrides, status=JobStatus.FAILED)
    job_return.return_value = error
    return job_return


def _ended_without_results(job: Any, state: str) -> str:
    if state.split()[0] == "PREEMPTED":
        return (f"SLURM job {job.job_id} was preempted and not requeued (the partition's PreemptMode cancels "
                "preempted jobs): its ranks saved a checkpoint on SIGTERM if the grace time allowed. Resume with the "
                "command its log prints after 'resume with:' (this sweep's command with hydra.sweep.dir=<the sweep "
                f"directory>): each point continues from its own checkpoints/last. Logs: {job.paths.folder}")
    return (f"SLURM job {job.job_id} ended ({state}) without a result from every task: a rank died (killed, out of "
            f"memory) or failed, and srun stopped the others. Logs: {job.paths.folder}")


def wait_for_jobs(jobs: Sequence[Any], overrides: list[list[str]]) -> list[JobReturn]:
    """Each job's JobReturn (its rank 0's), once it finished; a job that ended without a result from every task
    (a rank killed, out of memory) is a failed JobReturn naming its state and logs."""
    returns: dict[int, JobReturn] = {}
    ended_at: dict[int, float] = {}
    while len(returns) < len(jobs):
        waiting = [i for i in range(len(jobs)) if i not in returns]
        states = slurm_states([jobs[i].job_id for i in waiting])
        for i in waiting:
            job = jobs[i]
            if _has_all_results(job):
                try:
                    returns[i] = job.results()[0]
                except Exception as error:  # a task raised: submitit re-raises it here with the job's traceback
                    returns[i] = _failed(overrides[i], error)
                continue
            state = states.get(job.job_id, "ENDED")
            if state.split()[0] in ACTIVE_STATES:
                ended_at.pop(i, None)
                continue
            ended_at.setdefault(i, time.monotonic())
            if time.monotonic() - ended_at[i] > RESULT_GRACE_S.get(state, FAILED_RESULT_GRACE_S):
                returns[i] = _failed(overrides[i], RuntimeError(_ended_without_results(job, state)))
        if len(returns) < len(jobs):
            time.sleep(POLL_INTERVAL_S)
    return [returns[i] for i in range(len(jobs))]


def check_slurm_job(dp_replicate: int, dp_shard: int | None, nodes: int, tasks_per_node: int,
                    gpus_per_node: int | None) -> int:
    """The ranks of one SLURM job (``nodes x tasks_per_node``) against the parallel layout, before submission;
    returns the world size."""
    if nodes < 1:
        raise config_error("hydra.launcher.nodes", nodes, "must be >= 1", "hydra.launcher.nodes=1")
    if tasks_per_node < 1:
        raise config_error(
            "hydra.launcher.tasks_per_node", tasks_per_node,
            "must be >= 1: it is the number of ranks per node (it follows hydra.launcher.gpus_per_node, which is 0 "
            "on a CPU cluster)",
            "hydra.launcher.tasks_per_node=<ranks per node>",
        )
    if gpus_per_node and tasks_per_node != gpus_per_node:
        raise config_error(
            "hydra.launcher.tasks_per_node", tasks_per_node,
            f"must equal hydra.launcher.gpus_per_node={gpus_per_node}: one rank per GPU",
            f"hydra.launcher.tasks_per_node={gpus_per_node}",
        )
    world_size = nodes * tasks_per_node
    degrees_fixed = dp_shard not in (None, -1) and not (dp_replicate == 1 and dp_shard == 1)
    if degrees_fixed and dp_replicate >= 1 and dp_shard >= 1 and dp_replicate * dp_shard != world_size:
        wanted = dp_replicate * dp_shard
        fixes = []
        if wanted % tasks_per_node == 0:
            fixes.append(f"hydra.launcher.nodes={wanted // tasks_per_node}")
        if world_size % dp_replicate == 0:
            fixes.append(f"parallelism.dp_shard={world_size // dp_replicate}")
        raise config_error(
            "parallelism", {"dp_replicate": dp_replicate, "dp_shard": dp_shard},
            f"dp_replicate x dp_shard = {wanted} but the SLURM job has hydra.launcher.nodes x "
            f"hydra.launcher.tasks_per_node = {nodes} x {tasks_per_node} = {world_size} ranks",
            " or ".join(fixes) or f"hydra.launcher.nodes and hydra.launcher.tasks_per_node giving {wanted} ranks",
        )
    resolve_dp_degrees(dp_replicate, dp_shard, world_size)
    return world_size
