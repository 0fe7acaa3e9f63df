"""One process started by a launcher takes the distributed path, as ``torchrun --nproc-per-node=1`` on one GPU does
(scripts/gpu_check.sh runs the same on NCCL).

``parallelism.dp_shard=1`` typed there is FSDP2 on a 1-rank mesh: a process group, every collective of a save,
DCP shards, an asynchronous save through its gloo side group, a resume. The default layout is DDP on a 1-rank
process group. Both must train exactly what one process without a launcher trains (the shared ``single_b8``
reference, on another SIMD kernel: tolerances from tests/tolerances.py), and the FSDP2 run resumes bit-exactly.
The ranks are started with the variables torchrun gives its workers (tests/launch_utils.rank_env).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import read_dcp_tensors
from tests.dist.conftest import DETERMINISTIC_RUN
from tests.dist.test_checkpoints import copy_run
from tests.dist.test_resume import assert_same_checkpoint, resume_args, update_digests
from tests.launch_utils import interval_metrics, last_weights, run_train, shared_by_workers
from tests.tolerances import assert_same_series, assert_same_weights

if TYPE_CHECKING:
    from tests.dist.conftest import Run

pytestmark = pytest.mark.dist

NUM_UPDATES, LR, SAVE_FREQ, RESUME_STEP = 6, 1e-4, 2, 4
# single_b8 of tests/dist/conftest.py: batch 8, 6 steps, one process without a launcher.
SAME_AS_SINGLE_B8 = [*DETERMINISTIC_RUN, "batch_size=8", "steps=6", "ema.enable=true"]
FSDP_ONE_RANK = [*SAME_AS_SINGLE_B8, "parallelism.dp_shard=1", "checkpoint.format=dcp", "checkpoint.async_save=true",
                 f"checkpoint.save_freq={SAVE_FREQ}"]


def _launch(overrides: list[str]) -> str:
    """One rank, started as torchrun starts its workers."""
    return run_train(overrides, nproc=1, launcher="spawn", timeout=240).stdout


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    with shared_by_workers(tmp_path_factory, "one_rank/fsdp") as run_dir:
        stdout_file = run_dir.with_suffix(".stdout")
        if not stdout_file.is_file():
            stdout_file.write_text(_launch([*FSDP_ONE_RANK, f"output_dir={run_dir}"]))
        return run_dir, stdout_file.read_text()


def _facts(step_dir: Path) -> dict:
    return json.loads((step_dir / L.TRAINING_STATE_DIR / L.TRAINING_STEP).read_text())["facts"]


def _assert_same_training(run_dir: Path, weights: dict, single: Run) -> None:
    metrics, expected = interval_metrics(run_dir), single.metrics()
    assert [m["step"] for m in metrics] == [m["step"] for m in expected] == list(range(1, NUM_UPDATES + 1))
    for key in ("loss", "grad_norm"):
        assert_same_series([m[key] for m in metrics], [m[key] for m in expected], list(range(NUM_UPDATES)), key)
    assert_same_weights(weights, single.weights(), NUM_UPDATES, LR)


def test_dp_shard_1_on_one_launched_process_is_fsdp2_on_a_process_group(
        fsdp_run: tuple[Path, str], layout_run: Callable[[str], Run]) -> None:
    run_dir, stdout = fsdp_run
    assert "topology: FSDP2: 1 shard (a 1-rank mesh) (world size 1)" in stdout, stdout[-3000:]
    # Only a run with a process group gathers where its ranks are.
    assert json.loads((run_dir / "placement.json").read_text())["shard_groups"] == [[0]]
    for step in range(SAVE_FREQ, NUM_UPDATES + 1, SAVE_FREQ):
        step_dir = L.checkpoints_root(run_dir) / L.step_dir_name(step)
        # DCP shards, written by the asynchronous writer (staged in host memory, then on the gloo side group).
        for shards in (step_dir / L.PRETRAINED_MODEL_DIR / L.MODEL_DCP_DIR, step_dir / L.TRAINING_STATE_DIR /
                       L.OPTIMIZER_DCP_DIR):
            assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp"], shards
        assert not (step_dir / L.PRETRAINED_MODEL_DIR / L.MODEL_SAFETENSORS).exists()
        assert _facts(step_dir)["topology"] == {"dp_replicate": 1, "dp_shard": 1, "world_size": 1, "layout": "fsdp"}
    assert stdout.count("MiB staged in host memory") == NUM_UPDATES // SAVE_FREQ

    final = L.checkpoints_root(run_dir) / L.step_dir_name(NUM_UPDATES) / L.PRETRAINED_MODEL_DIR / L.MODEL_DCP_DIR
    _assert_same_training(run_dir, read_dcp_tensors(final), layout_run("single_b8"))


def test_the_one_rank_fsdp2_run_resumes_bit_exactly(fsdp_run: tuple[Path, str], tmp_path: Path) -> None:
    reference, _ = fsdp_run
    resumed = copy_run(reference, tmp_path / "resumed")
    stdout = _launch(resume_args(resumed, RESUME_STEP))
    assert "topology: FSDP2: 1 shard (a 1-rank mesh) (world size 1)" in stdout
    assert f"Data sampler resumed sample-exact at epoch 0, sample offset {RESUME_STEP * 8}" in stdout
    for step in range(RESUME_STEP + SAVE_FREQ, NUM_UPDATES + 1, SAVE_FREQ):
        assert_same_checkpoint(L.checkpoints_root(resumed) / L.step_dir_name(step),
                               L.checkpoints_root(reference) / L.step_dir_name(step))
    digests = update_digests(resumed, RESUME_STEP)
    assert len(digests) == NUM_UPDATES - RESUME_STEP and digests == update_digests(reference, RESUME_STEP)


def test_the_default_layout_on_one_launched_process_is_ddp_on_a_process_group(
        tmp_path: Path, layout_run: Callable[[str], Run]) -> None:
    run_dir = tmp_path / "ddp"
    stdout = _launch([*SAME_AS_SINGLE_B8, f"output_dir={run_dir}"])
    assert "topology: DDP: 1 replica (a 1-rank process group) (world size 1)" in stdout, stdout[-3000:]
    assert json.loads((run_dir / "placement.json").read_text())["replicate_groups"] == [[0]]
    last = L.checkpoints_root(run_dir) / "last"
    assert _facts(last)["topology"] == {"dp_replicate": 1, "dp_shard": 1, "world_size": 1, "layout": "ddp"}
    _assert_same_training(run_dir, last_weights(run_dir), layout_run("single_b8"))
