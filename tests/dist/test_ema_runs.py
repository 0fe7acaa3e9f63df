"""The EMA of the weights on real runs: FSDP-2 and HSDP-2x2 average what one process averages, each rank holds the
average of its own shards, and a resume restores it bit for bit from either of its checkpoint files.

The layout comparisons reuse the layout runs of tests/dist/conftest.py (single_b8, fsdp_b4, single_b16 and hsdp_b4
keep the EMA); the resumes run on one FSDP-2 run with ``checkpoint.format=safetensors_dcp`` (the averages saved both
as DCP shards and gathered), trained once per session.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from safetensors.torch import load_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import convert_checkpoint, read_dcp_tensors
from lerobot_mg.checkpoint.state import read_json
from tests.dist.conftest import DETERMINISTIC_RUN
from tests.dist.test_checkpoints import copy_run
from tests.dist.test_resume import assert_same_checkpoint, assert_tensors_equal, resume_args
from tests.launch_utils import run_train, shared_by_workers
from tests.tolerances import weight_mismatches

if TYPE_CHECKING:
    from tests.dist.conftest import Run

pytestmark = pytest.mark.dist

LR = 1e-4  # DETERMINISTIC_RUN's optimizer.lr
EMA_RUN = [*DETERMINISTIC_RUN, "batch_size=4", "steps=6", "parallelism.dp_shard=2", "checkpoint.format=safetensors_dcp",
           "checkpoint.save_freq=2", "ema.enable=true"]


def ema_weights(step_dir: Path) -> dict:
    return load_file(str(step_dir / L.PRETRAINED_MODEL_EMA_DIR / L.MODEL_SAFETENSORS))


@pytest.mark.parametrize(("name", "reference"), [("fsdp_b4", "single_b8"), ("hsdp_b4", "single_b16")])
def test_the_ema_of_a_sharded_run_equals_one_process(layout_run: Callable[[str], Run], name: str,
                                                     reference: str) -> None:
    """After 6 updates the gathered EMA of FSDP-2 / HSDP-2x2 equals one process's within the weights' tolerances, it
    lags the weights, and each rank held the average of its own shard only (1/dp_shard of the one process's)."""
    run, single = layout_run(name), layout_run(reference)
    last, single_last = L.checkpoints_root(run.output_dir) / L.LAST_LINK, L.checkpoints_root(single.output_dir) / L.LAST_LINK
    assert read_json(last / L.TRAINING_STATE_DIR / L.EMA_STATE) == read_json(
        single_last / L.TRAINING_STATE_DIR / L.EMA_STATE)
    assert read_json(last / L.TRAINING_STATE_DIR / L.EMA_STATE)["updates"] == 6
    averaged, expected = ema_weights(last), ema_weights(single_last)
    assert not weight_mismatches(averaged, expected, num_updates=6, lr=LR)
    weights = run.weights()
    assert averaged.keys() == weights.keys()  # a complete pretrained model, buffers included
    moved = [key for key in weights if not (averaged[key] == weights[key]).all()]
    assert len(moved) > len(weights) / 2, moved  # the average is not the last weights
    assert sorted(p.name for p in (last / L.PRETRAINED_MODEL_EMA_DIR).iterdir()) == sorted(
        p.name for p in (last / L.PRETRAINED_MODEL_DIR).iterdir())

    sharded = json.loads((run.output_dir / "rank_bytes.json").read_text())
    whole = json.loads((single.output_dir / "rank_bytes.json").read_text())[0]
    assert whole["ema"] == whole["trainable_parameters"] > 0
    for held in sharded:
        assert held["ema"] == held["trainable_parameters"]
        assert abs(held["ema"] / whole["ema"] - 1 / 2) < 0.02, (held, whole)  # dp_shard = 2


def ema_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with shared_by_workers(tmp_path_factory, "ema/fsdp2_safetensors_dcp") as run_dir:
        if not (L.checkpoints_root(run_dir) / L.step_dir_name(6) / L.TRAINING_STATE_DIR / L.TRAINING_STEP).is_file():
            shutil.rmtree(run_dir, ignore_errors=True)
            run_train([*EMA_RUN, f"output_dir={run_dir}"], nproc=2, timeout=240)
        return run_dir


def assert_same_ema(actual_dir: Path, expected_dir: Path) -> None:
    assert read_json(actual_dir / L.TRAINING_STATE_DIR / L.EMA_STATE) == read_json(
        expected_dir / L.TRAINING_STATE_DIR / L.EMA_STATE)
    assert_tensors_equal(ema_weights(actual_dir), ema_weights(expected_dir), "gathered EMA")
    shards = Path(L.PRETRAINED_MODEL_EMA_DIR) / L.MODEL_DCP_DIR
    assert_tensors_equal(read_dcp_tensors(actual_dir / shards), read_dcp_tensors(expected_dir / shards), "EMA shards")


@pytest.mark.parametrize("saved_as", ["dcp_shards", "gathered_file"])
def test_resume_restores_the_ema_bit_exact(saved_as: str, tmp_path: Path,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """6 updates straight == 4, stop, resume to 6: the EMA (and everything else) bit-identical, whether the resume
    reads the averages from their DCP shards or, with the shards gone, splits the gathered file into its shards."""
    reference = ema_reference(tmp_path_factory)
    resumed = copy_run(reference, tmp_path / "resumed")
    if saved_as == "gathered_file":
        shutil.rmtree(L.checkpoints_root(resumed) / L.step_dir_name(4) / L.PRETRAINED_MODEL_EMA_DIR / L.MODEL_DCP_DIR)
    run_train(resume_args(resumed, 4), nproc=2, timeout=240)
    for step in (6,):
        actual, expected = (L.checkpoints_root(run) / L.step_dir_name(step) for run in (resumed, reference))
        assert_same_checkpoint(actual, expected)
        assert_same_ema(actual, expected)


def test_the_ema_starts_as_the_weights_and_converts_like_them(tmp_path: Path,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Diffusion Policy's schedule copies the weights for the first two updates; lerobot-mg-convert-dcp merges the
    EMA shards into the gathered file the run wrote, bit for bit."""
    reference = ema_reference(tmp_path_factory)
    step2 = L.checkpoints_root(reference) / L.step_dir_name(2)
    assert read_json(step2 / L.TRAINING_STATE_DIR / L.EMA_STATE) == {"updates": 2, "decay": 0.0}
    assert_tensors_equal(ema_weights(step2), load_file(str(step2 / L.PRETRAINED_MODEL_DIR / L.MODEL_SAFETENSORS)),
                         "EMA after two updates")

    copied = copy_run(reference, tmp_path / "copy")
    step6 = L.checkpoints_root(copied) / L.step_dir_name(6)
    (step6 / L.PRETRAINED_MODEL_EMA_DIR / L.MODEL_SAFETENSORS).unlink()  # only the shards are left
    convert_checkpoint(step6, delete_dcp=True)
    assert not (step6 / L.PRETRAINED_MODEL_EMA_DIR / L.MODEL_DCP_DIR).exists()
    assert_tensors_equal(ema_weights(step6), ema_weights(L.checkpoints_root(reference) / L.step_dir_name(6)),
                         "converted EMA")
