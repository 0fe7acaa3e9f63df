"""``plan=true plan_world_size=N``: one process plans the job it is about to submit (N ranks) and says whether it
fits ``plan_device_memory_gib``, without a process group; the plan equals the one printed under a real launch of N
processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from lerobot_mg.errors import ConfigError
from lerobot_mg.preflight import preflight
from tests.launch_utils import TINY_RUN, run_train
from tests.unit.test_memory_plan import _train_config


def _plan_lines(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory plan:"))
    end = next(i for i in range(start + 1, len(lines) + 1) if i == len(lines) or not lines[i].startswith("  "))
    return lines[start:end]


@pytest.mark.dist
def test_the_plan_of_2_ranks_from_one_process_equals_the_plan_under_torchrun(tmp_path: Path) -> None:
    common = [*TINY_RUN, "plan=true", "parallelism.dp_shard=2", "batch_size=4", "plan_device_memory_gib=64",
              f"output_dir={tmp_path / 'never_written'}"]
    planned = run_train([*common, "plan_world_size=2"], timeout=120).stdout
    launched = run_train(common, nproc=2, launcher="torchrun", timeout=120).stdout
    assert _plan_lines(planned) == _plan_lines(launched), planned[-3000:]
    assert "memory plan: FSDP2: 2 shards; batch_size 4 x dp_world_size 2 x grad_accum 1 = effective batch 8" in planned
    assert "  fit: each rank holds 0.00 GiB" in planned and "<= plan_device_memory_gib=64 64.00 GiB" in planned
    assert not (tmp_path / "never_written").exists() and "lerobot_mg train:" not in planned  # nothing started


def test_a_large_world_is_planned_in_one_process_and_checked_against_a_given_memory() -> None:
    cfg = _train_config(["plan=true", "plan_world_size=64", "parallelism.dp_replicate=8", "parallelism.dp_shard=8",
                         "plan_device_memory_gib=0.000001", "batch_size=4"])
    checked = preflight(cfg, world_size=1)  # one process: no process group is created
    assert checked.dims.world_size == 64 and checked.dims.dp_world_size == 64
    assert len(checked.memory.per_rank) == 64
    lines = checked.memory.describe()
    assert lines[0].startswith("memory plan: HSDP: 8 replicas x 8 shards")
    assert len(lines) < 20  # ranks that hold the same bytes share a line
    assert lines[-1].startswith("  does not fit: each rank holds") and "> plan_device_memory_gib=1e-06" in lines[-1]
    assert "Layouts that fit:" in lines[-1]


def test_plan_world_size_is_refused_where_it_cannot_apply() -> None:
    with pytest.raises(ConfigError, match=r"plan_world_size=2: only applies to a plan .* Fix: add plan=true"):
        preflight(_train_config(["plan_world_size=2"]), world_size=1)
    with pytest.raises(ConfigError, match=r"plan_device_memory_gib=8.0: only applies to a plan"):
        preflight(_train_config(["plan_device_memory_gib=8"]), world_size=1)
    with pytest.raises(ConfigError, match=r"plan_world_size=16: the layout asks for dp_replicate x dp_shard = 8 ranks. "
                                          r"Fix: plan_world_size=8, or parallelism.dp_shard=-1"):
        preflight(_train_config(["plan=true", "plan_world_size=16", "parallelism.dp_shard=8"]), world_size=1)
    with pytest.raises(ConfigError, match=r"plan_world_size=0: must be positive"):
        preflight(_train_config(["plan=true", "plan_world_size=0"]), world_size=1)
