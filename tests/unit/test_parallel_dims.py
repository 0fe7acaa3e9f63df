"""ParallelDims: how (dp_replicate, dp_shard) resolve on a given world size, with or without a launcher, and the
errors a user sees."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from lerobot_mg.distributed.accelerator import launched
from lerobot_mg.distributed.parallel_dims import Layout, ParallelDims, Topology
from lerobot_mg.errors import ConfigError


@pytest.mark.parametrize(
    ("dp_replicate", "dp_shard", "world_size", "expected"),
    [
        # dp_shard unset (the ddp preset) or both 1: every process is a replica, whatever the world size.
        (1, None, 1, (1, 1, "single", 1)),
        (1, None, 2, (2, 1, "ddp", 2)),
        (1, 1, 1, (1, 1, "single", 1)),
        (1, 1, 2, (2, 1, "ddp", 2)),
        (1, 1, 8, (8, 1, "ddp", 8)),
        (2, None, 2, (2, 1, "ddp", 2)),
        # dp_shard=-1 (the fsdp preset): shard over every process left after dp_replicate.
        (1, -1, 4, (1, 4, "fsdp", 4)),
        (2, -1, 4, (2, 2, "hsdp", 4)),
        (2, -1, 16, (2, 8, "hsdp", 16)),
        # Explicit degrees that multiply to the world size are taken as given.
        (1, 2, 2, (1, 2, "fsdp", 2)),
        (2, 2, 4, (2, 2, "hsdp", 4)),
    ],
)
def test_resolution_rules(dp_replicate: int, dp_shard: int | None, world_size: int, expected: tuple) -> None:
    dims = ParallelDims.resolve(dp_replicate, dp_shard, world_size)  # a plain python start when world_size is 1
    replicate, shard, layout, dp_world_size = expected
    assert (dims.dp_replicate, dims.dp_shard, dims.layout, dims.dp_world_size) == (
        replicate, shard, layout, dp_world_size
    )
    assert dims.world_size == world_size
    # Every rank loads its own micro-batch in all layouts: dp_world_size is the world, never the replicas.
    assert dims.dp_world_size == world_size


@pytest.mark.parametrize(
    ("dp_shard", "world_size", "launched", "layout"),
    [
        # One process started without a launcher has no process group, whatever the config asks.
        (None, 1, False, Layout.SINGLE),
        (1, 1, False, Layout.SINGLE),
        (-1, 1, False, Layout.SINGLE),
        # Under a launcher one process is distributed: DDP by default, FSDP2 on a 1-rank mesh when dp_shard is typed.
        (None, 1, True, Layout.DDP),
        (1, 1, True, Layout.FSDP),
        (-1, 1, True, Layout.FSDP),
        # A shard degree of 1 on several processes stays plain replication (a sharded run resumed as DDP).
        (1, 2, True, Layout.DDP),
        (None, 2, True, Layout.DDP),
        (-1, 2, True, Layout.FSDP),
        # Several processes always come from a launcher.
        (2, 2, False, Layout.FSDP),
    ],
)
def test_a_launcher_gives_one_process_the_distributed_layouts(dp_shard: int | None, world_size: int, launched: bool,
                                                              layout: Layout) -> None:
    dims = ParallelDims.resolve(1, dp_shard, world_size, launched=launched)
    assert dims.layout is layout
    assert (dims.is_distributed, dims.is_sharded) == (layout.distributed, layout.sharded)
    assert dims.dp_world_size == world_size


def test_one_rank_layouts_are_described_and_saved_as_what_they_are() -> None:
    fsdp1 = ParallelDims.resolve(1, 1, 1, launched=True)
    ddp1 = ParallelDims.resolve(1, None, 1, launched=True)
    assert fsdp1.describe() == "FSDP2: 1 shard (a 1-rank mesh)"
    assert ddp1.describe() == "DDP: 1 replica (a 1-rank process group)"
    assert asdict(fsdp1.topology) == {"dp_replicate": 1, "dp_shard": 1, "world_size": 1, "layout": "fsdp"}
    assert fsdp1.topology != ddp1.topology != ParallelDims.resolve(1, 1, 1).topology


def test_topologies_saved_before_the_layout_was_a_field_read_back_as_they_ran() -> None:
    """Run facts written by older versions carry the degrees (and a derived layout string): a topology built from
    the degrees alone is what those runs were."""
    assert Topology(1, 2, 2).layout is Layout.FSDP
    assert Topology(2, 2, 4).layout is Layout.HSDP
    assert Topology(1, 1, 4).layout is Layout.DDP
    assert Topology(1, 1, 1).layout is Layout.SINGLE
    assert Topology(1, 1, 1, "fsdp").layout is Layout.FSDP  # a layout read from JSON


def test_the_launcher_environment_decides_launched() -> None:
    torchrun_one = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    assert launched(torchrun_one) and launched({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"})
    assert not launched({"PATH": "/usr/bin"})  # plain python


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
    assert rank0 == rank3 == Topology(2, 2, 4, Layout.HSDP)
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
