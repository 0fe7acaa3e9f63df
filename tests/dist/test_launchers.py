"""The launchers: plain `accelerate launch`, the environment guard under it, and the console command.

A launcher only starts processes, so the same run started another way must train bit for bit the same as the
torchrun of scripts/train.py (``layout_run("ddp_b4")``): same losses, same weights.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.dist.conftest import DETERMINISTIC_RUN, LAYOUT_RUNS
from tests.launch_utils import TINY_RUN, interval_metrics, last_weights, run_train

if TYPE_CHECKING:
    from tests.dist.conftest import Run

pytestmark = pytest.mark.dist

CONSOLE_COMMAND = Path(sys.executable).parent / "lerobot-mg-train"  # installed by `pip install -e .`
DDP_OVERRIDES = [*DETERMINISTIC_RUN, *LAYOUT_RUNS["ddp_b4"][1]]
CONFIG_FILE_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "FULL_SHARD"}


def _assert_same_run(output_dir: Path, stdout: str, reference: Run) -> None:
    assert "topology: DDP: 2 replicas (world size 2)" in stdout, stdout[-3000:]
    assert "batch: batch_size 4 x dp_world_size 2 x grad_accum 1 = effective batch 8" in stdout
    losses = [m["loss"] for m in reference.metrics()]
    assert len(losses) == 6
    assert [m["loss"] for m in interval_metrics(output_dir)] == losses
    weights, expected = last_weights(output_dir), reference.weights()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def test_plain_accelerate_launch_trains_like_torchrun(layout_run: Callable[[str], Run], tmp_path: Path) -> None:
    output_dir = tmp_path / "accelerate"
    proc = run_train([*DDP_OVERRIDES, f"output_dir={output_dir}"], nproc=2, launcher="accelerate", timeout=180)
    _assert_same_run(output_dir, proc.stdout, layout_run("ddp_b4"))


def test_accelerate_config_variables_are_refused(tmp_path: Path) -> None:
    output_dir = tmp_path / "refused"
    proc = run_train([*TINY_RUN, "steps=2", f"output_dir={output_dir}"], nproc=2, launcher="accelerate",
                     env=CONFIG_FILE_ENV, timeout=120, check=False)
    assert proc.returncode != 0
    assert "ACCELERATE_USE_FSDP=true FSDP_SHARDING_STRATEGY=FULL_SHARD: accelerate configuration" in proc.stdout, proc.stdout[-3000:]
    assert "Fix: put these settings in parallelism.* / accelerator.* overrides" in proc.stdout
    assert "set LEROBOT_ALLOW_ACCELERATE_ENV=1 to acknowledge the override and proceed anyway" in proc.stdout
    # Refused before anything was set up: no run directory, no banner.
    assert not output_dir.exists()
    assert "lerobot_mg train:" not in proc.stdout


def test_acknowledged_accelerate_variables_proceed(tmp_path: Path) -> None:
    output_dir = tmp_path / "acknowledged"
    proc = run_train([*TINY_RUN, "steps=2", f"output_dir={output_dir}"], nproc=2, launcher="accelerate",
                     env={**CONFIG_FILE_ENV, "LEROBOT_ALLOW_ACCELERATE_ENV": "1"}, timeout=180)
    assert "LEROBOT_ALLOW_ACCELERATE_ENV=1: proceeding" in proc.stdout, proc.stdout[-3000:]
    assert "FSDP_SHARDING_STRATEGY=FULL_SHARD" in proc.stdout
    # Our config still decides the layout: DDP, as the overrides say, not the FSDP the variables ask for.
    assert "topology: DDP: 2 replicas (world size 2)" in proc.stdout
    assert (output_dir / "checkpoints" / "last" / "pretrained_model" / "model.safetensors").is_file()


def test_console_command_under_torchrun_trains_like_the_script(
    layout_run: Callable[[str], Run], tmp_path: Path
) -> None:
    assert CONSOLE_COMMAND.is_file(), f"{CONSOLE_COMMAND} is missing: run `pip install -e .` (make setup)"
    output_dir = tmp_path / "console"
    # torchrun of `$(which lerobot-mg-train)`: the launch helper's torchrun command with the console script.
    proc = run_train([*DDP_OVERRIDES, f"output_dir={output_dir}"], nproc=2, script=CONSOLE_COMMAND, timeout=180)
    _assert_same_run(output_dir, proc.stdout, layout_run("ddp_b4"))
