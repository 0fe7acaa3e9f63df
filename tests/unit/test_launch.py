"""The launch helpers in one process: a SLURM task's torch.distributed variables, the SLURM job checks made before
submission, the preemption watch on a real signal, why a run resumes, and what one train() call must leave behind
(with the negative control: without the teardown, the next run of a local sweep cannot build its Accelerator).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest

from lerobot_mg.config.schema import AcceleratorConfig
from lerobot_mg.distributed.accelerator import build_accelerator
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.errors import ConfigError
from lerobot_mg.launch.placement import Placement
from lerobot_mg.launch.preemption import PREEMPTION_RECORD, PreemptionWatch, resume_cause
from lerobot_mg.launch.run_state import RUN_LOG_FILENAME, attach_run_log, releases_run_state
from lerobot_mg.launch.slurm_env import (
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    SlurmTask,
    expand_task_counts,
    export_torch_distributed_env,
)
from lerobot_mg.launch.submitit_launcher import check_slurm_job
from lerobot_mg.launch.sweep import check_sweep_point
from lerobot_mg.run_facts import ResumeCause

# Rank 3 of a 2-node x 2-task srun step (the values srun sets; the node list needs no expansion).
SRUN_TASK = {
    "SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "4",
}


def test_an_srun_task_exports_the_torch_distributed_variables() -> None:
    environ = dict(SRUN_TASK)
    export_torch_distributed_env(environ)
    assert {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1"}
    assert environ["MASTER_PORT"] == str(MASTER_PORT_BASE + 4711 % MASTER_PORT_SPAN)
    assert environ["CUDA_VISIBLE_DEVICES"] == ""  # no SLURM_GPUS_ON_NODE: the job has no GPU here


def test_master_port_is_stable_per_job_and_distinct_between_jobs() -> None:
    def port(job_id: int) -> int:
        return SlurmTask.from_environ({**SRUN_TASK, "SLURM_JOB_ID": str(job_id)}).master_port  # type: ignore[union-attr]

    assert port(4711) == port(4711)  # a requeued job keeps its id, hence its port
    assert len({port(job_id) for job_id in range(4711, 4711 + 500)}) == 500  # jobs side by side never share one
    assert all(MASTER_PORT_BASE <= port(job_id) < 32768 for job_id in (1, 11_999, 12_000, 10**7))


def test_launchers_own_variables_and_non_step_processes_are_left_alone() -> None:
    torchrun = {**SRUN_TASK, "RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}  # torchrun inside an allocation
    export_torch_distributed_env(environ := dict(torchrun))
    assert environ == torchrun
    batch_shell = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}  # the sbatch script itself
    export_torch_distributed_env(environ := dict(batch_shell))
    assert environ == batch_shell


def test_gpus_come_from_slurm_gpus_on_node() -> None:
    environ = {**SRUN_TASK, "SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "a100:2"}
    export_torch_distributed_env(environ)
    assert "CUDA_VISIBLE_DEVICES" not in environ  # the task keeps the node's GPUs and takes the LOCAL_RANK-th
    with pytest.raises(ConfigError, match="2 tasks share the 1 GPU"):
        export_torch_distributed_env({**SRUN_TASK, "SLURM_GPUS_ON_NODE": "1"})


def test_task_counts_expand() -> None:
    assert expand_task_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_task_counts("4") == [4]


# --- checks before submission ---------------------------------------------------------------------------------


def test_slurm_job_ranks_must_match_the_layout() -> None:
    assert check_slurm_job(2, 8, nodes=2, tasks_per_node=8, gpus_per_node=8) == 16
    assert check_slurm_job(1, 2, nodes=1, tasks_per_node=2, gpus_per_node=0) == 2
    assert check_slurm_job(2, -1, nodes=2, tasks_per_node=2, gpus_per_node=0) == 4
    with pytest.raises(ConfigError) as error:
        check_slurm_job(2, 4, nodes=2, tasks_per_node=8, gpus_per_node=8)
    assert str(error.value) == (
        "parallelism={'dp_replicate': 2, 'dp_shard': 4}: dp_replicate x dp_shard = 8 but the SLURM job has "
        "hydra.launcher.nodes x hydra.launcher.tasks_per_node = 2 x 8 = 16 ranks. Fix: hydra.launcher.nodes=1 or "
        "parallelism.dp_shard=8"
    )
    with pytest.raises(ConfigError, match=r"hydra.launcher.tasks_per_node=0: must be >= 1"):
        check_slurm_job(1, 2, nodes=1, tasks_per_node=0, gpus_per_node=0)
    with pytest.raises(ConfigError, match=r"must equal hydra.launcher.gpus_per_node=8: one rank per GPU\. Fix: "
                                         r"hydra.launcher.tasks_per_node=8"):
        check_slurm_job(1, 4, nodes=1, tasks_per_node=4, gpus_per_node=8)


def test_a_sweep_point_owns_its_directory() -> None:
    check_sweep_point(None, False)
    with pytest.raises(ConfigError, match=r"output_dir='/x': is set in a sweep .* Fix: remove output_dir"):
        check_sweep_point("/x", False)
    with pytest.raises(ConfigError, match=r"resume=True: in a sweep"):
        check_sweep_point(None, True)


# --- preemption -----------------------------------------------------------------------------------------------


def test_the_watch_records_the_signal_and_stops_at_accumulation_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    from submitit.core.job_environment import SignalHandler

    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")  # submitit's variable moves the watch too
    dims = ParallelDims.resolve(1, 1, 1)
    previous = signal.getsignal(signal.SIGUSR1)
    assert not PreemptionWatch(dims, 2).active  # no submitit handler: nothing to requeue

    submitit_handler = SignalHandler.__new__(SignalHandler)  # stands for the handler submitit installs in a job
    signal.signal(signal.SIGUSR1, submitit_handler.checkpoint_and_try_requeue)
    try:
        watch = PreemptionWatch(dims, accumulation_steps=2)
        assert watch.active and not watch.agreed(2)
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to this (main) thread before kill returns
        assert watch.received_at is not None
        assert not watch.agreed(3)  # inside an accumulation window: its gradients are not checkpointed
        assert watch.agreed(4)
        watch.uninstall()
        assert signal.getsignal(signal.SIGUSR1) == submitit_handler.checkpoint_and_try_requeue
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_resume_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert resume_cause(tmp_path, 10) == ResumeCause.RELAUNCH
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert resume_cause(tmp_path, 10) == ResumeCause.REQUEUE  # e.g. a node failed: back to the periodic checkpoint
    (tmp_path / PREEMPTION_RECORD).write_text(json.dumps(
        {"signal": "SIGUSR2", "loop_step": 7, "time": 0.0, "slurm_job_id": "4711"}))
    assert resume_cause(tmp_path, 7) == ResumeCause.PREEMPTION
    assert resume_cause(tmp_path, 10) == ResumeCause.REQUEUE  # a later checkpoint than the preemption's


def test_placement_verdicts() -> None:
    guide = Placement([0, 0, 1, 1], ["a"] * 4, [[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert guide.shard_groups_within_nodes and guide.replication_across_nodes
    crossed = Placement([0, 1, 0, 1], ["a"] * 4, [[0, 1], [2, 3]], [[0, 2], [1, 3]])  # ranks round-robin over nodes
    assert not crossed.shard_groups_within_nodes and not crossed.replication_across_nodes


# --- one run's process state ----------------------------------------------------------------------------------


def _build(mixed_precision: str, output_dir: Path) -> None:
    attach_run_log(output_dir, is_main=True)
    logging.getLogger("lerobot_mg.test").warning("run with %s", mixed_precision)
    os.environ["LEROBOT_MG_TEST_LEFTOVER"] = mixed_precision
    build_accelerator(AcceleratorConfig(mixed_precision=mixed_precision, cpu=True), ParallelDims.resolve(1, 1, 1))


def test_each_run_leaves_the_process_as_it_found_it(tmp_path: Path) -> None:
    run = releases_run_state(_build)
    run("bf16", tmp_path / "a")
    run("no", tmp_path / "b")  # a second Accelerator with another precision builds
    assert (tmp_path / "a" / RUN_LOG_FILENAME).read_text().count("run with") == 1  # b's record is not in a's log
    assert "LEROBOT_MG_TEST_LEFTOVER" not in os.environ
    assert not any(type(h).__name__ == "RunLogHandler" for h in logging.getLogger().handlers)


def test_without_the_teardown_the_next_run_cannot_build(tmp_path: Path) -> None:
    releases_run_state(lambda: None)()  # start from a clean state, whatever ran before in this process
    try:
        _build("bf16", tmp_path / "a")
        with pytest.raises(ValueError, match="AcceleratorState has already been initialized"):
            _build("no", tmp_path / "b")
    finally:
        releases_run_state(lambda: None)()
