"""Fault drills on real process groups: a rank that raises or is SIGKILLed mid-training.

The fault is injected by the run itself at an exact rank and loop step (``LEROBOT_MG_FAULT``,
lerobot_mg/drills.py), so no test races a timer. Each drill checks that the launcher exits non-zero
before the watchdog, which is shorter than the default ``accelerator.process_group_timeout_s`` (so a run that
waited for a collective to time out fails; how many seconds the teardown takes is the machine's and is not
asserted), that no process of the run is left, and that ``resume=true`` from the last complete
checkpoint ends on the weights of an uninterrupted run of the same configuration: the reference runs that
tests/dist/test_checkpoints.py and the layout tests train anyway.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.schema import AcceleratorConfig
from lerobot_mg.drills import FAULT_ENV
from tests.dist.conftest import DETERMINISTIC_RUN, LAYOUT_RUNS
from tests.dist.test_checkpoints import REFERENCE_RUNS, SAVE_FREQ, reference_run
from tests.launch_utils import (
    TINY_RUN,
    clean_env,
    descendants,
    kill_tree,
    last_weights,
    launch_command,
    run_train,
)

if TYPE_CHECKING:
    from tests.dist.conftest import Run

pytestmark = pytest.mark.dist

WATCHDOG_S = 240  # a drill's run that outlives it failed to stop; below the default collective timeout (600 s)


@dataclass(frozen=True)
class Watched:
    returncode: int
    output: str
    fault_to_exit_s: float  # from the drill's announcement to the launcher's exit
    pids: set[int]  # every process seen below the launcher while it ran


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def launch_watched(overrides: list[str], nproc: int, fault: str, launcher: str = "torchrun",
                   timeout: float = WATCHDOG_S) -> Watched:
    """Run the trainer with ``LEROBOT_MG_FAULT=fault``, recording its process tree and when the drill fired."""
    cmd = [*launch_command(nproc, launcher), *overrides]
    proc = subprocess.Popen(cmd, env=clean_env({FAULT_ENV: fault}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    fired: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("fault drill:") and not fired:
                fired.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pids: set[int] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            kill_tree(proc)
            raise AssertionError(f"watchdog: {cmd} ran over {timeout}s\n{''.join(lines)[-6000:]}")
        pids.update(descendants(proc.pid))
        time.sleep(0.05)
    exited = time.monotonic()
    reader.join(timeout=30)
    output = "".join(lines)
    assert fired, f"the drill never fired\n{output[-6000:]}"
    return Watched(proc.returncode, output, exited - fired[0], pids)


def assert_stopped_promptly(watched: Watched, nproc: int) -> None:
    assert watched.returncode != 0, watched.output[-4000:]
    # Stopped without waiting for a collective timeout: launch_watched's watchdog, shorter than that timeout, would
    # have failed the run. The seconds it took are the machine's, so they are printed, not asserted.
    assert WATCHDOG_S < AcceleratorConfig().process_group_timeout_s
    print(f"fault drill: fault -> launcher exit in {watched.fault_to_exit_s:.1f} s")
    assert len(watched.pids) >= nproc, watched.pids  # the sampling saw the ranks
    # An orphan is reaped by init once it exits, a live one stays: a watchdog, not a bound on how fast they go.
    deadline = time.monotonic() + 60
    while (left := sorted(pid for pid in watched.pids if _alive(pid))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


def test_a_failure_on_rank_1_stops_the_job_with_its_traceback(tmp_path: Path) -> None:
    """accelerate launch, DDP-2: rank 1 raises in its second loop step. The job stops at once, and the output has
    rank 1's full traceback naming the rank (printed by the rank, and as the launcher's root cause)."""
    watched = launch_watched([*TINY_RUN, "steps=4", "batch_size=4", f"output_dir={tmp_path / 'run'}"], nproc=2,
                             fault="raise@rank1:step2", launcher="accelerate")
    assert_stopped_promptly(watched, 2)
    out = watched.output
    assert "lerobot-mg-train: rank 1 of 2 (local rank 1" in out, out[-4000:]
    assert "Traceback (most recent call last)" in out and "FaultDrillError: fault drill: injected failure on rank 1" in out
    assert "in after_backward" in out  # the frames, not a one-line summary
    # The elastic agent read rank 1's error file: its summary names the rank and carries the traceback.
    root_cause = out[out.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "FaultDrillError" in root_cause, root_cause
    assert "HYDRA_FULL_ERROR" not in out


def _checkpoint_run(name: str) -> tuple[int, list[str], int]:
    spec = REFERENCE_RUNS[name]
    return spec.nproc, [*TINY_RUN, f"steps={spec.steps}", f"checkpoint.save_freq={SAVE_FREQ}", "log_freq=2",
                        *spec.overrides], spec.steps


def _layout_run(name: str) -> tuple[int, list[str], int]:
    nproc, overrides = LAYOUT_RUNS[name]
    steps = int(next(o for o in overrides if o.startswith("steps=")).split("=")[1])
    # Checkpoints every SAVE_FREQ loop steps as well: saving reads state, it changes no number of the run.
    return nproc, [*DETERMINISTIC_RUN, *overrides, f"checkpoint.save_freq={SAVE_FREQ}"], steps


# name -> (the uninterrupted run: a test_checkpoints reference run or a layout run; the loop step the kill strikes;
# whether to resume). Loop step SAVE_FREQ + 1 follows the first checkpoint. With accumulation 2 it is the first
# micro-batch of update 3: killed between its backward and the next micro-batch. The HSDP-2x2 drill stops at the
# launcher's exit (its resume from the same checkpoint is test_resume's, and 4 more ranks would double its cost).
DRILLS = {
    "fsdp2_mid_step": ("checkpoint:fsdp2", SAVE_FREQ + 1, True),
    "hsdp2x2_mid_step": ("checkpoint:hsdp2x2_bf16", SAVE_FREQ + 1, False),
    "ddp2_mid_accumulation": ("layout:ddp_b2_accum2", SAVE_FREQ + 1, True),
}


@pytest.mark.parametrize("drill", list(DRILLS))
def test_sigkill_of_one_rank_then_resume(drill: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                         layout_run: Callable[[str], Run]) -> None:
    source, kill_step, resume = DRILLS[drill]
    kind, name = source.split(":")
    nproc, overrides, steps = _checkpoint_run(name) if kind == "checkpoint" else _layout_run(name)
    run_dir = tmp_path / "run"
    watched = launch_watched([*overrides, f"output_dir={run_dir}"], nproc, f"kill@rank1:step{kill_step}")
    assert_stopped_promptly(watched, nproc)
    assert "fault drill: rank 1 kills at loop step" in watched.output

    root = L.checkpoints_root(run_dir)
    assert (root / "last").resolve().name == L.step_dir_name(SAVE_FREQ)  # the last complete checkpoint
    if not resume:
        return
    config = root / "last" / L.PRETRAINED_MODEL_DIR / "train_config.json"
    run_train(["resume=true", f"config_path={config}"], nproc=nproc, timeout=240)

    expected = last_weights(reference_run(tmp_path_factory, name) if kind == "checkpoint" else layout_run(name).output_dir)
    assert (root / "last").resolve().name == L.step_dir_name(steps)
    actual = last_weights(run_dir)
    assert actual.keys() == expected.keys()
    mismatched = [key for key, tensor in expected.items() if not torch.equal(actual[key], tensor)]
    assert not mismatched, mismatched
