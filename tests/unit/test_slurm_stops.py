"""What the SLURM launcher reports for a job that ended without its results: a preempted job that the cluster
cancelled (PreemptMode=CANCEL) is reported at once as such, with how to resume it, not waited on as if it were
still running. The job objects are submitit's own, on a real folder; SLURM's answer (squeue) is given."""

from __future__ import annotations

from pathlib import Path

import pytest
from submitit.slurm.slurm import SlurmJob

from lerobot_mg.launch import submitit_launcher
from lerobot_mg.launch.submitit_launcher import ACTIVE_STATES, wait_for_jobs


@pytest.mark.parametrize(("state", "message"), [
    ("PREEMPTED", r"SLURM job 7_0 was preempted and not requeued \(the partition's PreemptMode cancels preempted "
                  r"jobs\): .* each point continues from its own checkpoints/last"),
    ("FAILED", r"SLURM job 7_0 ended \(FAILED\) without a result from every task: a rank died"),
])
def test_a_job_that_ended_without_results_is_reported_for_what_it_is(
        state: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert state not in ACTIVE_STATES  # PREEMPTED is final: a requeued job shows REQUEUED or PENDING
    monkeypatch.setattr(submitit_launcher, "slurm_states", lambda job_ids: {"7_0": state})
    monkeypatch.setattr(submitit_launcher, "RESULT_GRACE_S", {})  # no shared file system to wait for here
    monkeypatch.setattr(submitit_launcher, "FAILED_RESULT_GRACE_S", 0.0)
    monkeypatch.setattr(submitit_launcher, "POLL_INTERVAL_S", 0.01)
    (returned,) = wait_for_jobs([SlurmJob(tmp_path, "7_0")], [["job_name=a"]])
    assert returned.status.name == "FAILED"
    with pytest.raises(RuntimeError, match=message):
        raise returned._return_value
