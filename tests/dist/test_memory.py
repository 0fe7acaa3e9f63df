"""``plan=true`` against what a real 2-rank FSDP run holds, and the start-up refusal of a run that cannot fit."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.dist.conftest import DETERMINISTIC_RUN, LAYOUT_RUNS
from tests.launch_utils import run_train

if TYPE_CHECKING:
    from tests.dist.conftest import Run

pytestmark = pytest.mark.dist

_RANK_LINE = re.compile(r"rank (\d+) \(host RAM\): parameters ([\d.]+) MiB \(trainable ([\d.]+)\) \+ gradients "
                        r"([\d.]+) \+ optimizer state ([\d.]+) \+ EMA ([\d.]+) = ([\d.]+) MiB")
COMPONENTS = ("parameters", "trainable_parameters", "gradients", "optimizer_state", "ema", "total")


def test_plan_matches_what_a_2_rank_fsdp_run_holds(layout_run: Callable[[str], Run], tmp_path: Path) -> None:
    """The plan of the fsdp_b4 layout run's configuration (EMA on), printed under torchrun, per rank and component,
    within 5 % of the bytes that run measured on its prepared model after its last update (rank_bytes.json)."""
    nproc, overrides = LAYOUT_RUNS["fsdp_b4"]
    out_dir = tmp_path / "never_written"
    proc = run_train([*DETERMINISTIC_RUN, *overrides, f"output_dir={out_dir}", "plan=true"], nproc=nproc, timeout=120)
    assert not out_dir.exists()  # nothing trained, nothing written
    assert "lerobot_mg train:" not in proc.stdout  # no banner: the run never started
    assert ("memory plan: FSDP2: 2 shards; batch_size 4 x dp_world_size 2 x grad_accum 1 = effective batch 8"
            in proc.stdout), proc.stdout[-3000:]
    assert "  wrap units (ACTPolicy._fsdp_wrap_modules=['ACTEncoderLayer', 'ACTDecoderLayer']): " in proc.stdout
    planned = {int(m[1]): dict(zip(COMPONENTS, (float(value) for value in m.groups()[1:])))
               for m in _RANK_LINE.finditer(proc.stdout)}
    held = json.loads((layout_run("fsdp_b4").output_dir / "rank_bytes.json").read_text())
    assert sorted(planned) == [0, 1] and len(held) == 2
    for rank, measured in enumerate(held):
        for component in COMPONENTS:
            mib = measured[component] / 2**20
            assert abs(planned[rank][component] - mib) <= 0.05 * mib, (rank, component, planned[rank], measured)


def test_a_run_larger_than_the_host_is_refused_at_start_up(tmp_path: Path) -> None:
    """~400 GB of parameters, gradients and AdamW moments: refused before anything is allocated or started."""
    out_dir = tmp_path / "never_written"
    proc = run_train(["experiment=pusht_debug", "policy.dim_model=16384", "policy.dim_feedforward=65536",
                      "policy.n_encoder_layers=8", f"output_dir={out_dir}"],
                     check=False, timeout=120, env={"HYDRA_FULL_ERROR": "0"})
    assert proc.returncode == 2, proc.stdout[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("lerobot-mg-train: error:"))
    assert re.search(r"parallelism\.dp_shard=1: each rank holds [\d.]+ GiB of training state \(parameters "
                     r"[\d.]+ \+ gradients [\d.]+ \+ optimizer state [\d.]+\), x 1 rank\(s\) = [\d.]+ GiB > available "
                     r"host RAM [\d.]+ GiB", line), line
    assert "Traceback" not in proc.stdout and not out_dir.exists()
