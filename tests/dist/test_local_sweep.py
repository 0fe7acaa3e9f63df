"""A local Hydra sweep (-m, Hydra's basic launcher): every point runs in one Python process, one after another.

Four points: two precisions x two datasets, the second dataset broken (its metadata is there, its data files are
not, so the point fails after the Accelerator and the run directory exist). The good points must each get their own
run directory, checkpoints, configs and ledger; the failed ones are reported and leave the next point untouched: the
fp32 point that follows a bf16 run and a failure trains bit for bit like the same run started on its own
(``layout_run("single_b8")``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from lerobot_mg.accounting.ledger import read_ledger
from tests.dist.conftest import DETERMINISTIC_RUN, LAYOUT_RUNS
from tests.launch_utils import PUSHT_SLICE, last_weights, run_train

if TYPE_CHECKING:
    from tests.dist.conftest import Run

pytestmark = pytest.mark.dist


def test_local_sweep_points_are_separate_runs(layout_run: Callable[[str], Run], tmp_path: Path) -> None:
    broken = tmp_path / "broken_dataset"
    shutil.copytree(PUSHT_SLICE / "meta", broken / "meta")
    sweep_dir = tmp_path / "sweep"
    proc = run_train(["-m", *DETERMINISTIC_RUN, *LAYOUT_RUNS["single_b8"][1], f"hydra.sweep.dir={sweep_dir}",
                      "accelerator=bf16,fp32", f"dataset.root={PUSHT_SLICE},{broken}"], check=False, timeout=300)
    # Points: 0 bf16 good, 1 bf16 broken, 2 fp32 good, 3 fp32 broken. Every point ran; the sweep exits non-zero.
    assert proc.returncode != 0, proc.stdout[-4000:]
    for failed in (1, 3):
        assert f"sweep job #{failed} (" in proc.stdout and f"dataset.root={broken}) failed: " in proc.stdout
        assert not (sweep_dir / str(failed) / "checkpoints").exists()

    for point, precision in ((0, "bf16"), (2, "no")):
        run_dir = sweep_dir / str(point)
        train_config = json.loads((run_dir / "train_config.json").read_text())
        assert train_config["output_dir"] == str(run_dir)
        assert train_config["accelerator"]["mixed_precision"] == precision
        assert train_config["logging"]["wandb"]["group"] == str(sweep_dir)
        assert (run_dir / "config.yaml").is_file()
        assert _last_step(run_dir) == 6
        assert [s.start.kind for s in read_ledger(run_dir).segments] == ["start"]

    # Nothing of the bf16 run or of the failure leaked into the fp32 point: it is the standalone run, bit for bit.
    reference = layout_run("single_b8")
    metrics = [json.loads(line) for line in (sweep_dir / "2" / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == [m["loss"] for m in reference.metrics()]
    weights, expected = last_weights(sweep_dir / "2"), reference.weights()
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)


def _last_step(run_dir: Path) -> int:
    return json.loads((run_dir / "checkpoints/last/training_state/training_step.json").read_text())["step"]
