"""The stop watch in real processes on gloo, without training: which signal a stop is decided for when two arrive
across two flag exchanges, and a second SIGTERM ending a rank that is blocked in a collective.

The ranks run :data:`_AGREE` / :data:`_BLOCKED` (below) as two real processes; the signals are real, sent by the
ranks to themselves at fixed points between the watch's exchanges, so no test races a timer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.launch_utils import REPO, clean_env, free_port, kill_tree, rank_env, spawn_ranks

pytestmark = pytest.mark.dist

# Each scenario: (rank, signal) sent before the watch's boundary 1, then before boundary 2. submitit's requeue
# handler is installed on USR2 (as in a SLURM job), so the watch treats USR2 as the preemption signal.
_AGREE = textwrap.dedent("""
    import json, os, signal, sys
    from datetime import timedelta
    import torch.distributed as dist
    from submitit.core.job_environment import SignalHandler
    from lerobot_mg.distributed.parallel_dims import ParallelDims
    from lerobot_mg.launch.preemption import PreemptionWatch

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    dims = ParallelDims.resolve(1, 1, 2, rank=rank, local_rank=rank)
    signal.signal(signal.SIGUSR2, SignalHandler(None, None, None).checkpoint_and_try_requeue)
    results = {}
    for name, (first, second) in json.loads(sys.argv[1]).items():
        watch = PreemptionWatch(dims, 1, timedelta(seconds=300))
        decisions = []
        for boundary, send in enumerate((first, second, None, None), start=1):
            if send is not None and send[0] == rank:
                signal.raise_signal(signal.Signals[send[1]])  # its handler runs before raise_signal returns
            if watch.agreed(boundary):
                decisions.append((boundary, watch.cause.name))
                break
        watch.finish()
        watch.uninstall()
        results[name] = decisions
    # One write for the whole line: unbuffered (PYTHONUNBUFFERED), print writes its parts one by one, and the
    # other rank's line could land between them in the shared pipe.
    sys.stdout.write(f"RESULT {rank} {json.dumps(results)}\\n")
    dist.destroy_process_group()
""")

SCENARIOS = {
    # SIGTERM reaches rank 0 before boundary 1, the preemption signal rank 1 before boundary 2: a stop is known at
    # boundary 2 (from boundary 1's exchange) and decided from boundary 2's flags: a requeue.
    "term_then_usr2": [[0, "SIGTERM"], [1, "SIGUSR2"]],
    "usr2_then_term": [[1, "SIGUSR2"], [0, "SIGTERM"]],
    "term_only": [[1, "SIGTERM"], None],
}


def test_the_stop_is_decided_from_the_latest_flags_and_the_preemption_signal_wins(tmp_path: Path) -> None:
    proc = spawn_ranks([sys.executable, "-c", _AGREE, json.dumps(SCENARIOS)], 2,
                       clean_env({"PYTHONPATH": str(REPO)}), REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = [json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2 and results[0] == results[1], proc.stdout[-4000:]  # every rank decides the same
    assert results[0] == {
        "term_then_usr2": [[2, "SIGUSR2"]],  # read from boundary 1's exchange alone, it would have been SIGTERM
        "usr2_then_term": [[2, "SIGUSR2"]],
        "term_only": [[2, "SIGTERM"]],
    }


# Rank 0 gets a first SIGTERM (recorded by the watch), then blocks in an all-reduce rank 1 never joins.
_BLOCKED = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from lerobot_mg.distributed.parallel_dims import ParallelDims
    from lerobot_mg.launch.preemption import PreemptionWatch

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    watch = PreemptionWatch(ParallelDims.resolve(1, 1, 2, rank=rank, local_rank=rank), 1, timedelta(seconds=900))
    if rank == 1:
        time.sleep(900)  # never joins the collective below; the test kills it
    signal.raise_signal(signal.SIGTERM)  # the first stop signal: a checkpoint would follow
    assert watch.stop_signal == signal.SIGTERM
    print("blocking", flush=True)
    dist.all_reduce(torch.zeros(1))  # blocked in C until rank 1 joins: never
    print("all_reduce returned", flush=True)
""")


def test_a_second_sigterm_ends_a_rank_blocked_in_a_collective(tmp_path: Path) -> None:
    """A Python handler cannot run while the rank waits inside gloo; the default action restored after the first
    signal is the kernel's, so the second one ends the rank (killed by SIGTERM, no exit status of its own)."""
    env, port = clean_env({"PYTHONPATH": str(REPO)}), free_port()
    logs = [(tmp_path / f"rank{r}.log").open("w+") for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", _BLOCKED], env=rank_env(env, r, 2, port), cwd=REPO,
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(2)]
    try:
        deadline = time.monotonic() + 300  # a watchdog for the start-up, not a bound on speed
        while "blocking" not in (tmp_path / "rank0.log").read_text():
            assert ranks[0].poll() is None and time.monotonic() < deadline, (tmp_path / "rank0.log").read_text()
            time.sleep(0.1)
        os.kill(ranks[0].pid, signal.SIGTERM)
        try:
            returncode = ranks[0].wait(timeout=120)  # a watchdog: without the default action it waits 900 s
        except subprocess.TimeoutExpired:
            returncode = None
        out = (tmp_path / "rank0.log").read_text()
        assert returncode == -signal.SIGTERM, out[-3000:]
        assert "all_reduce returned" not in out
    finally:
        for rank in ranks:
            kill_tree(rank)
        for log in logs:
            log.close()
