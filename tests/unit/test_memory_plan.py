"""The memory plan (lerobot_mg/distributed/memory.py): its shard arithmetic, and the refusal with layouts that fit.

The plan against what a real 2-rank FSDP run holds is in tests/dist/test_faults.py (it reuses a layout run).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from lerobot_mg.config import register_configs
from lerobot_mg.config.loading import CONF_DIR, to_train_config
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.distributed.memory import (
    MemoryBudget,
    MemoryPlan,
    check_fits,
    param_facts,
    plan_memory,
    planned_rank_bytes,
)
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.errors import ConfigError
from lerobot_mg.preflight import meta_policy
from tests.launch_utils import PUSHT_SLICE


def _train_config(overrides: list[str]) -> TrainConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=["experiment=pusht_debug", f"dataset.root={PUSHT_SLICE}",
                                                          *overrides])
    return to_train_config(composed)


def _plan(cfg: TrainConfig, dims: ParallelDims) -> MemoryPlan:
    return plan_memory(cfg, dims, meta_policy(cfg, DatasetMeta.read(PUSHT_SLICE)))


def test_shards_follow_torch_chunk() -> None:
    """5 rows over 4 shards: torch.chunk gives 2, 2, 1, 0 rows (FSDP2's split), not 2, 1, 1, 1."""
    model = nn.Linear(3, 5)  # weight (5, 3), bias (5,)
    facts = param_facts(model, ignored_modules=None)
    expected_rows = [len(chunk) for chunk in torch.chunk(torch.empty(5), 4)] + [0]
    for shard, rows in enumerate(expected_rows[:4]):
        held = planned_rank_bytes(facts, 4, shard, upcast_trainable=False)
        assert held.parameters == rows * (3 + 1) * 4
        assert held.gradients == held.trainable_parameters == held.parameters
        assert held.optimizer_state == 2 * held.parameters + 2 * 4  # two moments + one step counter per parameter
    ignored = planned_rank_bytes(param_facts(model, ignored_modules=""), 4, 3, upcast_trainable=False)
    assert ignored.parameters == (5 * 3 + 5) * 4  # the root module matched: nothing of it is sharded


def test_a_run_that_does_not_fit_is_refused_with_the_layouts_that_would() -> None:
    cfg = _train_config(["parallelism.dp_shard=4"])
    plan = _plan(cfg, ParallelDims.resolve(1, 4, 4))
    sharded = plan.busiest.total
    whole = _plan(_train_config([]), ParallelDims.resolve(1, 1, 4)).busiest.total
    assert 3.5 < whole / sharded < 4.5  # parameters, gradients and moments all split four ways

    check_fits(plan, MemoryBudget(4 * sharded, "available host RAM", 4))  # exactly enough for 4 ranks of a node
    with pytest.raises(ConfigError) as refused:
        check_fits(plan, MemoryBudget(4 * sharded - 1, "available host RAM", 4))
    message = str(refused.value)
    assert message.startswith("parallelism.dp_shard=4: each rank holds")
    assert "x 4 rank(s)" in message and "> available host RAM" in message
    assert "mixed precision would not shrink it" in message
    assert message.endswith("Fix: no layout of this world size fits: more ranks (a larger dp_shard), LoRA (peft=lora) "
                            "or a smaller policy")
    # On a GPU, offloading the sharded state to host RAM is the way out.
    with pytest.raises(ConfigError) as refused:
        check_fits(replace(plan, gpu=True), MemoryBudget(sharded - 1, "free memory of cuda:0", 1))
    assert "parallelism.dp_replicate=1 parallelism.dp_shard=4 accelerator.fsdp.cpu_offload=true" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        check_fits(_plan(_train_config([]), ParallelDims.resolve(1, 1, 4)),
                   MemoryBudget(3 * sharded, "available host RAM", 1))
    fix = str(refused.value).split("Fix:")[1]
    assert "parallelism.dp_replicate=1 parallelism.dp_shard=4" in fix
    assert "parallelism.dp_replicate=4 parallelism.dp_shard=1" not in fix


def test_mixed_precision_keeps_fp32_master_state() -> None:
    fp32 = _plan(_train_config(["parallelism.dp_shard=2"]), ParallelDims.resolve(1, 2, 2))
    bf16 = _plan(_train_config(["parallelism.dp_shard=2", "accelerator=bf16"]), ParallelDims.resolve(1, 2, 2))
    assert bf16.per_rank == fp32.per_rank
