"""ParallelDims: how (dp_replicate, dp_shard) resolve on a given world size, and the errors a user sees."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from lerobot_mg.distributed.parallel_dims import ParallelDims, Topology
from lerobot_mg.errors import ConfigError


@pytest.mark.parametrize(
    ("dp_replicate", "dp_shard", "world_size", "expected"),
    [
        # Both 1 (the ddp preset): every process is a replica, whatever the world size.
        (1, 1, 1, (1, 1, "single", 1)),
        (1, 1, 2, (2, 1, "ddp", 2)),
        (1, 1, 8, (8, 1, "ddp", 8)),
        # dp_shard=-1 (the fsdp preset): shard over every process left after dp_replicate.
        (1, -1, 4, (1, 4, "fsdp", 4)),
        (2, -1, 4, (2, 2, "hsdp", 4)),
        (2, -1, 16, (2, 8, "hsdp", 16)),
        # Explicit degrees that multiply to the world size are taken as given.
        (1, 2, 2, (1, 2, "fsdp", 2)),
        (2, 2, 4, (2, 2, "hsdp", 4)),
    ],
)
def test_resolution_rules(dp_replicate: int, dp_shard: int, world_size: int, expected: tuple) -> None:
    dims = ParallelDims.resolve(dp_replicate, dp_shard, world_size)
    replicate, shard, layout, dp_world_size = expected
    assert (dims.dp_replicate, dims.dp_shard, dims.layout, dims.dp_world_size) == (
        replicate, shard, layout, dp_world_size
    )
    assert dims.world_size == world_size
    # Every rank loads its own micro-batch in all layouts: dp_world_size is the world, never the replicas.
    assert dims.dp_world_size == world_size


def test_layout_flags_and_descriptions() -> None:
    single = ParallelDims.resolve(1, 1, 1)
    ddp = ParallelDims.resolve(1, 1, 4, rank=3, local_rank=1)
    fsdp = ParallelDims.resolve(1, -1, 2)
    hsdp = ParallelDims.resolve(2, 2, 4)

    assert (single.is_distributed, single.is_sharded, single.dp_replicate, single.dp_shard) == (False, False, 1, 1)
    assert (ddp.is_distributed, ddp.is_sharded, ddp.dp_replicate, ddp.dp_shard) == (True, False, 4, 1)
    assert (fsdp.is_distributed, fsdp.is_sharded, fsdp.dp_replicate, fsdp.dp_shard) == (True, True, 1, 2)
    assert (hsdp.is_distributed, hsdp.is_sharded, hsdp.dp_replicate, hsdp.dp_shard) == (True, True, 2, 2)

    assert single.describe() == "single process"
    assert ddp.describe() == "DDP: 4 replicas"
    assert fsdp.describe() == "FSDP2: 2 shards"
    assert hsdp.describe() == "HSDP: 2 replicas x 2 shards (mesh dp_replicate x dp_shard)"

    assert single.is_main_process and not ddp.is_main_process
    assert (ddp.rank, ddp.local_rank) == (3, 1)


def test_saveable_topology_has_no_ranks() -> None:
    """The topology goes into checkpoints and the ledger: two ranks of one run must write the same one."""
    rank0 = ParallelDims.resolve(2, 2, 4, rank=0, local_rank=0).topology
    rank3 = ParallelDims.resolve(2, 2, 4, rank=3, local_rank=1).topology
    assert rank0 == rank3 == Topology(2, 2, 4)
    assert asdict(rank0) == {"dp_replicate": 2, "dp_shard": 2, "world_size": 4, "layout": "hsdp"}
    assert rank0.describe() == "HSDP: 2 replicas x 2 shards (mesh dp_replicate x dp_shard)"


def test_degrees_that_do_not_multiply_to_the_world_size_are_refused() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelDims.resolve(2, 2, 2)
    message = str(info.value)
    assert message.startswith("parallelism={'dp_replicate': 2, 'dp_shard': 2}: ")
    assert "dp_replicate x dp_shard = 4 but the launcher started 2 process(es)" in message
    assert "Fix: parallelism.dp_shard=-1" in message
    assert "launch 4 processes" in message


def test_shard_over_all_needs_replicas_that_divide_the_world() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelDims.resolve(3, -1, 4)
    message = str(info.value)
    assert message.startswith("parallelism.dp_replicate=3: does not divide the 4 processes")
    assert "Fix: parallelism.dp_replicate=<a divisor of 4>" in message


@pytest.mark.parametrize(
    ("dp_replicate", "dp_shard", "key", "fix"),
    [
        (0, 1, "parallelism.dp_replicate=0", "Fix: parallelism.dp_replicate=1"),
        (1, 0, "parallelism.dp_shard=0", "Fix: parallelism.dp_shard=-1"),
        (1, -2, "parallelism.dp_shard=-2", "Fix: parallelism.dp_shard=-1"),
    ],
)
def test_impossible_degrees_are_refused(dp_replicate: int, dp_shard: int, key: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        ParallelDims.resolve(dp_replicate, dp_shard, 4)
    assert str(info.value).startswith(key + ": ")
    assert fix in str(info.value)


def test_hsdp_that_leaves_one_shard_per_replica_is_refused_not_silently_ddp() -> None:
    # The hsdp preset (dp_replicate=2, dp_shard=-1) on 2 processes would be plain replication.
    with pytest.raises(ConfigError) as info:
        ParallelDims.resolve(2, -1, 2)
    message = str(info.value)
    assert message.startswith("parallelism.dp_shard=-1:") and "not HSDP" in message
    assert "Fix: launch 4+ processes for HSDP, or parallelism=ddp" in message
