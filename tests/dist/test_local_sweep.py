"""A local Hydra sweep (-m, Hydra's basic launcher) on two torchrun "nodes" of this host (``--nnodes=2
--node-rank=0/1 --rdzv-endpoint``, static rendezvous, 2 ranks each): every rank runs every point in its one Python
process, one after another, so each point builds and tears down a process group and accelerate's state.

Three HSDP points on the same settings, the middle one on a broken dataset (its metadata is there, its data files
are not, so the point fails after the process group, the Accelerator and the run directory exist). The good points
each get their own run directory, checkpoints, configs and ledger; the failed one is reported and leaves the next
point untouched: both good points, the last one after an HSDP run and a failure (accelerate's relabelled CPU state,
the mesh sub-groups, the ACCELERATE_USE_FSDP it wrote, a process group torn down mid-run), train bit for bit like
the same run started on its own (``layout_run("hsdp_b4")``), and record the guide's placement: each shard group
inside one node (ranks 0-1, 2-3), replication across nodes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from lerobot_mg.accounting.ledger import read_ledger
from tests.dist.conftest import DETERMINISTIC_RUN, LAYOUT_RUNS
from tests.launch_utils import (
    PUSHT_SLICE,
    PYTHON,
    REPO,
    TRAIN_SCRIPT,
    clean_env,
    free_port,
    interval_metrics,
    kill_tree,
    last_weights,
)

if TYPE_CHECKING:
    from tests.dist.conftest import Run

pytestmark = pytest.mark.dist


def _two_nodes(args: list[str], tmp_path: Path, timeout: float) -> tuple[list[int], list[str]]:
    """Run scripts/train.py as two torchrun nodes of 2 ranks; (exit codes, outputs) of node 0 and node 1."""
    endpoint = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    launchers = []
    for node, log_path in enumerate(logs):
        cmd = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2",
               f"--rdzv-endpoint={endpoint}", str(TRAIN_SCRIPT), *args]
        with open(log_path, "w") as log:
            launchers.append(subprocess.Popen(cmd, env=clean_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [launcher.wait(timeout=timeout) for launcher in launchers]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"watchdog: the two nodes ran over {timeout}s\n{logs[0].read_text()[-4000:]}") from None
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                kill_tree(launcher)
    return codes, [log.read_text() for log in logs]


def _last_step(run_dir: Path) -> int:
    return json.loads((run_dir / "checkpoints/last/training_state/training_step.json").read_text())["step"]


def test_local_sweep_on_two_nodes_runs_each_point_as_its_own_run(layout_run: Callable[[str], Run],
                                                                  tmp_path: Path) -> None:
    broken = tmp_path / "broken_dataset"
    shutil.copytree(PUSHT_SLICE / "meta", broken / "meta")
    sweep_dir = tmp_path / "sweep"
    overrides = [*DETERMINISTIC_RUN, *LAYOUT_RUNS["hsdp_b4"][1], f"hydra.sweep.dir={sweep_dir}",
                 f"dataset.root={PUSHT_SLICE},{broken},{PUSHT_SLICE}"]
    codes, (stdout, _) = _two_nodes(["-m", *overrides], tmp_path, timeout=400)
    # Every point ran; the sweep exits non-zero.
    assert codes[0] != 0 and codes[1] != 0, stdout[-4000:]
    assert "sweep job #1 (" in stdout and f"dataset.root={broken}) failed: " in stdout, stdout[-4000:]
    assert not (sweep_dir / "1" / "checkpoints").exists()

    reference = layout_run("hsdp_b4")
    for point in (0, 2):
        run_dir = sweep_dir / str(point)
        train_config = json.loads((run_dir / "train_config.json").read_text())
        assert train_config["output_dir"] == str(run_dir)
        assert train_config["logging"]["wandb"]["group"] == str(sweep_dir)  # one wandb group per sweep
        assert train_config["trackio"]["group"] == str(sweep_dir)  # and one trackio group
        assert (run_dir / "config.yaml").is_file() and _last_step(run_dir) == 6
        assert [s.start.kind for s in read_ledger(run_dir).segments] == ["start"]
        # Nothing of an earlier point leaked into this one: it is the standalone run, bit for bit.
        assert [m["loss"] for m in interval_metrics(run_dir)] == [m["loss"] for m in reference.metrics()]
        weights, expected = last_weights(run_dir), reference.weights()
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)

        # Shard within each node, replicate across nodes (torchrun's node ranks).
        placement = json.loads((run_dir / "placement.json").read_text())
        assert placement["node_of_rank"] == [0, 0, 1, 1]
        assert placement["shard_groups"] == [[0, 1], [2, 3]] and placement["replicate_groups"] == [[0, 2], [1, 3]]
        assert placement["shard_groups_within_nodes"] and placement["replication_across_nodes"]
        assert ("shard groups [[0, 1], [2, 3]] each within one node; replicate groups [[0, 2], [1, 3]] across "
                "nodes") in (run_dir / "train.log").read_text()


# The trainer, with every background checkpoint write held back until the fault drill has fired: the first point
# fails while its save is in flight. Prints the threads left once the sweep is over.
_HELD_WRITE_PROBE = '''
import threading

from lerobot_mg import drills
from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.scripts_entry import train

fired = threading.Event()
_write, _after_backward = CheckpointManager._write, drills.FaultDrill.after_backward


def held_write(self, writes, tmp):
    fired.wait(120)
    _write(self, writes, tmp)


def after_backward(self):
    try:
        _after_backward(self)
    finally:
        if self._steps_seen == self.step:
            fired.set()


CheckpointManager._write, drills.FaultDrill.after_backward = held_write, after_backward
try:
    train()
finally:
    print("threads left:", sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
          flush=True)
'''


def test_a_point_that_fails_during_a_background_save_releases_its_writer(tmp_path: Path) -> None:
    """One process, two points: the first (steps=4) fails at loop step 3 while its step-2 save is still being
    written in the background; the second (steps=2, which never reaches the drill's step) trains and saves. The
    first point's save completes (what it staged before the failure is a checkpoint), and no writer thread is
    left behind."""
    from lerobot_mg.drills import FAULT_ENV
    from tests.launch_utils import TINY_RUN, run_train

    probe = tmp_path / "probe.py"
    probe.write_text(_HELD_WRITE_PROBE)
    sweep_dir = tmp_path / "sweep"
    proc = run_train(["-m", *TINY_RUN, "steps=4,2", "checkpoint.save_freq=2", "checkpoint.async_save=true",
                      f"hydra.sweep.dir={sweep_dir}"], timeout=240, env={FAULT_ENV: "raise@rank0:step3"},
                     script=probe, check=False)
    out = proc.stdout
    assert proc.returncode != 0 and "sweep job #0 (" in out and "FaultDrillError" in out, out[-4000:]
    assert _last_step(sweep_dir / "0") == 2  # the save in flight at the failure was completed
    assert _last_step(sweep_dir / "1") == 2  # the second point trained to its end
    threads = next(line for line in out.splitlines() if line.startswith("threads left:"))
    assert "checkpoint-writer" not in threads, threads
