"""SLURM for real, through the Hydra submitit launcher, on the local 2-node cluster of `make slurm-local`.

One sweep of four identical HSDP jobs (2 nodes x 2 tasks, dp_replicate=2 x dp_shard=2, gloo), which only differ
in job_name, runs side by side and gives every test below its facts:

- ``reference`` runs undisturbed: it trains, checkpoints, exits 0, and records its mesh;
- ``preempted`` gets submitit's preemption signal and then SIGTERM (``scancel --signal=USR2``, then
  ``--signal=TERM``: the time limit's pair under ``--signal=USR2@N``, or a preemption with
  ``PreemptParameters=send_user_signal``): it must save, be requeued by submitit, resume by itself and end on
  weights bit-identical to ``reference``;
- ``requeued`` gets SIGTERM alone from ``scontrol requeue`` (what ``PreemptMode=REQUEUE`` does: SIGTERM, then SLURM
  requeues the job itself): it must save, exit, come back, resume by itself and end bit-identical to ``reference``;
- ``killed`` loses a rank to SIGKILL: the job must end non-zero without waiting for a collective timeout (the
  sweep's watchdog is shorter than it), leaving no process behind, while the other two points finish unharmed.

Outside CI a missing cluster skips these tests with the command that starts one; in CI (CI=true) it fails them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.config.schema import AcceleratorConfig
from lerobot_mg.launch.submitit_launcher import ACTIVE_STATES, slurm_states
from lerobot_mg.run_facts import ResumeCause
from tests.launch_utils import PYTHON, REPO, TINY_RUN, TRAIN_SCRIPT, clean_env, last_weights, run_train

pytestmark = pytest.mark.dist

POINTS = ("reference", "preempted", "requeued", "killed")
TWO_NODES_TWO_TASKS = [
    "hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=2", "hydra.launcher.gpus_per_node=0",
]
STEPS = 30
SWEEP = [*TWO_NODES_TWO_TASKS, "parallelism.dp_replicate=2", "parallelism.dp_shard=2", *TINY_RUN,
         f"steps={STEPS}", "checkpoint.save_freq=15", "log_freq=1", f"job_name={','.join(POINTS)}"]
SWEEP_WATCHDOG_S = 480  # below the default collective timeout (600 s): a job that waited for it fails the sweep


def _cluster_problem() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "SLURM's client commands are not installed"
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    up = [line for line in out.stdout.splitlines() if line.split()[-1].rstrip("*") in ("idle", "mix", "alloc")]
    return None if len(up) >= 2 else f"fewer than 2 nodes up: {out.stdout.strip()!r}"


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    """Skip (outside CI) or fail (in CI) when no SLURM cluster answers."""
    problem = _cluster_problem()
    if problem is not None:
        message = f"no local SLURM cluster ({problem}): start one with `make slurm-local`"
        if os.environ.get("CI") == "true":
            pytest.fail(message)  # CI provides the cluster: its absence is a failure, never a skip
        pytest.skip(message)


@dataclass
class Sweep:
    sweep_dir: Path
    returncode: int
    log: str
    array_id: str
    final_states: dict[str, str]
    signalled_at: float
    killed_at: float
    dead_at: float
    leftover_pids: list[int]

    def run_dir(self, point: str) -> Path:
        return self.sweep_dir / str(POINTS.index(point))

    def job_id(self, point: str) -> str:
        return f"{self.array_id}_{POINTS.index(point)}"


def _metric_lines(run_dir: Path) -> int:
    """Interval records in the run's ledger so far: one per log step."""
    path = run_dir / "ledger.jsonl"
    return path.read_text().count('"kind": "interval"') if path.is_file() else 0


def _task_pids(array_id: str, array_task: int | None = None, rank: int | None = None) -> list[int]:
    """The python processes srun started for a job of the sweep (by their SLURM environment)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if b"submitit.core._submit" not in (proc / "cmdline").read_bytes():
                continue
            environ = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
        except (OSError, ValueError):
            continue
        if environ.get("SLURM_ARRAY_JOB_ID") != array_id:
            continue
        if array_task is not None and environ.get("SLURM_ARRAY_TASK_ID") != str(array_task):
            continue
        if rank is not None and environ.get("SLURM_PROCID") != str(rank):
            continue
        pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def sweep(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sweep]:
    sweep_dir = tmp_path_factory.mktemp("slurm") / "sweep"
    log_path = sweep_dir.parent / "launcher.log"
    cmd = [PYTHON, str(TRAIN_SCRIPT), "-m", *SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    run_dirs = {point: sweep_dir / str(i) for i, point in enumerate(POINTS)}
    array_id, signalled_at, requeued_at, killed_at, dead_at = None, 0.0, 0.0, 0.0, 0.0
    killed = POINTS.index("killed")
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(cmd, env=clean_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SWEEP_WATCHDOG_S
    try:
        while launcher.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"watchdog: the SLURM sweep ran over {SWEEP_WATCHDOG_S} s\n"
                                     f"{log_path.read_text()[-6000:]}")
            if array_id is None:
                folders = list((sweep_dir / ".submitit").glob("*_0"))
                array_id = folders[0].name.split("_")[0] if folders else None
            elif not signalled_at and _metric_lines(run_dirs["preempted"]) >= 2:  # its watch is in place
                job = f"{array_id}_{POINTS.index('preempted')}"
                subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
                subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
                signalled_at = time.time()
            elif not requeued_at and _metric_lines(run_dirs["requeued"]) >= 2:
                subprocess.run(["scontrol", "requeue", f"{array_id}_{POINTS.index('requeued')}"], check=True,
                               timeout=30)
                requeued_at = time.time()
            elif not killed_at and _metric_lines(run_dirs["killed"]) >= 1:
                victims = _task_pids(array_id, array_task=killed, rank=1)
                assert len(victims) == 1, victims
                os.kill(victims[0], signal.SIGKILL)
                killed_at = time.time()
            elif killed_at and not dead_at:
                state = slurm_states([f"{array_id}_{killed}"]).get(f"{array_id}_{killed}", "ENDED")
                if state not in ACTIVE_STATES:
                    dead_at = time.time()
            time.sleep(0.1)
        assert array_id is not None and signalled_at and requeued_at and killed_at, log_path.read_text()[-6000:]
        if not dead_at:
            dead_at = time.time()  # the launcher noticed first: an upper bound
        # The launcher returns once every task wrote its result; SLURM closes the jobs a moment later (polled for up
        # to 120 s: a watchdog, not a bound on how fast SLURM is).
        job_ids = [f"{array_id}_{i}" for i in range(len(POINTS))]
        for _ in range(1200):
            final_states = slurm_states(job_ids)
            if not ACTIVE_STATES & set(final_states.values()):
                break
            time.sleep(0.1)
        yield Sweep(sweep_dir, launcher.returncode, log_path.read_text(), array_id, final_states, signalled_at,
                    killed_at, dead_at, _task_pids(array_id))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
        if array_id is not None:
            subprocess.run(["scancel", array_id], timeout=30)


@pytest.mark.slurm
def test_hsdp_job_trains_checkpoints_exits_0_and_shards_within_nodes(sweep: Sweep) -> None:
    run_dir = sweep.run_dir("reference")
    assert sweep.final_states[sweep.job_id("reference")] == "COMPLETED", sweep.final_states
    step = json.loads((run_dir / "checkpoints/last/training_state/training_step.json").read_text())
    topology = step["facts"]["topology"]
    assert step["step"] == STEPS and topology["layout"] == "hsdp" and topology["world_size"] == 4
    assert os.readlink(run_dir / "checkpoints/last") == f"{STEPS:06d}"
    assert (run_dir / "checkpoints/000015/training_state/optimizer_0").is_dir()  # HSDP: per-rank DCP shards
    # The guide's mesh: shard within each node (ranks 0-1 on node 0, 2-3 on node 1), replicate across nodes.
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["node_of_rank"] == [0, 0, 1, 1]
    assert placement["shard_groups"] == [[0, 1], [2, 3]] and placement["replicate_groups"] == [[0, 2], [1, 3]]
    assert placement["shard_groups_within_nodes"] and placement["replication_across_nodes"]


@pytest.mark.slurm
def test_each_sweep_job_has_its_own_run_directory(sweep: Sweep) -> None:
    for point in ("reference", "preempted"):
        run_dir = sweep.run_dir(point)
        train_config = json.loads((run_dir / "train_config.json").read_text())
        assert train_config["output_dir"] == str(run_dir) and train_config["job_name"] == point
        assert train_config["logging"]["wandb"]["group"] == str(sweep.sweep_dir)  # one wandb group per sweep
        assert f"job_name: {point}" in (run_dir / "config.yaml").read_text()
        assert read_ledger(run_dir).segments[0].start.kind == "start"
        assert (run_dir / "checkpoints/last/pretrained_model/model.safetensors").is_file()


def _check_stopped_and_resumed(sweep: Sweep, point: str, signal_name: str, requeued_by_us: bool,
                               cause: ResumeCause) -> int:
    """The job of ``point`` stopped once on ``signal_name`` with a checkpoint, came back, resumed it by itself and
    ended exactly where the reference did; returns the step it stopped at."""
    run_dir, reference = sweep.run_dir(point), sweep.run_dir("reference")
    assert sweep.final_states[sweep.job_id(point)] == "COMPLETED", sweep.final_states
    ledger = read_ledger(run_dir)
    assert [s.start.kind for s in ledger.segments] == ["start", "resume"]
    stop, resume = ledger.segments[0].stop, ledger.segments[1].start
    assert stop is not None and stop.signal == signal_name and stop.requeued == requeued_by_us
    stop_step = stop.progress.step
    assert 2 <= stop_step < STEPS and stop.checkpoint == str(run_dir / f"checkpoints/{stop_step:06d}")
    assert resume.progress.step == stop_step and resume.facts.resume_cause == cause
    assert resume.facts.resumed_from == str(run_dir / f"checkpoints/{stop_step:06d}")
    # Resumed by itself, in the same directory, and it ends at the same total loop steps as the reference...
    progress = json.loads((run_dir / "checkpoints/last/training_state/training_step.json").read_text())["progress"]
    assert progress == json.loads((reference / "checkpoints/last/training_state/training_step.json").read_text())[
        "progress"]
    # ... on the same samples, update by update, and on bit-identical weights.
    digests = [(u.loop_step, u.digest) for u in ledger.updates]
    assert digests == [(u.loop_step, u.digest) for u in read_ledger(reference).updates] and len(digests) == STEPS
    weights, expected = last_weights(run_dir), last_weights(reference)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)
    # The run's log is written once, by the main process, across both attempts.
    assert (run_dir / "train.log").read_text().count(f"{signal_name} received") == 1
    return stop_step


@pytest.mark.slurm
def test_preemption_signal_then_sigterm_saves_requeues_and_resumes_bit_identical(sweep: Sweep) -> None:
    """USR2 then TERM: whichever of the two the ranks had by their decision, the preemption signal wins and
    submitit requeues the job."""
    stop_step = _check_stopped_and_resumed(sweep, "preempted", "SIGUSR2", True, ResumeCause.PREEMPTION)
    record = json.loads((sweep.run_dir("preempted") / "preemption.json").read_text())
    assert record["signal"] == "SIGUSR2" and record["loop_step"] == stop_step
    print(f"\nrequeue timeline: signal -> checkpoint at step {stop_step} {record['time'] - sweep.signalled_at:.1f} s")


@pytest.mark.slurm
def test_sigterm_alone_saves_exits_and_slurm_requeue_resumes_bit_identical(sweep: Sweep) -> None:
    """scontrol requeue (PreemptMode=REQUEUE's path): SIGTERM, a checkpoint, exit 143; SLURM brings the job back
    and it resumes by itself. The printed resume command is the sweep's own command line, not submitit's."""
    stop_step = _check_stopped_and_resumed(sweep, "requeued", "SIGTERM", False, ResumeCause.REQUEUE)
    run_dir = sweep.run_dir("requeued")
    assert not (run_dir / "preemption.json").exists()  # submitit did not requeue it: SLURM did
    outputs = "".join(p.read_text() for p in (sweep.sweep_dir / ".submitit").rglob(f"{sweep.job_id('requeued')}_0_log.out"))
    stopped = next(line for line in outputs.splitlines() if line.startswith(f"stopped at loop step {stop_step}"))
    assert stopped.startswith(f"stopped at loop step {stop_step} on SIGTERM: checkpoint {run_dir}/checkpoints/"), stopped
    command = stopped.split("; resume with: ", 1)[1].split()
    assert command[1:3] == [str(TRAIN_SCRIPT), "-m"] and command[-1] == f"hydra.sweep.dir={sweep.sweep_dir}", stopped
    assert command.count(f"hydra.sweep.dir={sweep.sweep_dir}") == 1


@pytest.mark.slurm
def test_a_dead_rank_fails_the_job_before_a_collective_timeout(sweep: Sweep) -> None:
    job_id = sweep.job_id("killed")
    elapsed = sweep.dead_at - sweep.killed_at  # the machine's and SLURM's: printed, not asserted
    print(f"\ndead rank: SIGKILL -> job ended ({sweep.final_states.get(job_id)}) in {elapsed:.1f} s")
    # The sweep ended before its watchdog, which is shorter than the collective timeout the other ranks would
    # otherwise have waited for.
    assert SWEEP_WATCHDOG_S < AcceleratorConfig().process_group_timeout_s
    assert sweep.final_states.get(job_id, "FAILED") == "FAILED", sweep.final_states
    assert sweep.leftover_pids == []  # no rank of any job of the sweep is left running
    # The launcher reports the failed point and exits non-zero; the other points were not touched (tests above).
    assert sweep.returncode != 0
    assert f"SLURM job {job_id} ended (FAILED) without a result from every task" in sweep.log, sweep.log[-4000:]


def test_a_layout_that_does_not_fit_the_job_is_refused_before_submission(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = run_train(["-m", *TWO_NODES_TWO_TASKS, "parallelism.dp_replicate=2", "parallelism.dp_shard=4", *TINY_RUN,
                      f"hydra.sweep.dir={sweep_dir}"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert (
        "lerobot-mg-train: error: sweep job #0 (parallelism.dp_replicate=2 parallelism.dp_shard=4 experiment=pusht_debug logging.progress_bar=False logging.wandb.mode=disabled): "
        "parallelism={'dp_replicate': 2, 'dp_shard': 4}: dp_replicate x dp_shard = 8 but the SLURM job has "
        "hydra.launcher.nodes x hydra.launcher.tasks_per_node = 2 x 2 = 4 ranks. Fix: hydra.launcher.nodes=4 or "
        "parallelism.dp_shard=2\n"
    ) in proc.stdout
    assert not (sweep_dir / ".submitit").exists()  # nothing was queued
