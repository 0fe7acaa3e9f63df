"""DDP, FSDP2 and HSDP train the same model as one process does, on real gloo process groups.

Each distributed run is compared with a one-process run of the same effective batch (the sampler gives
both the same global batches). The one-process references run on another SIMD kernel (AVX2 where the CPU has
AVX-512), so the comparison also holds on a CPU other than the one that wrote it. Tolerances and why they hold
on any CPU: tests/tolerances.py. ``test_the_tolerances_reject_another_global_batch`` is their negative control.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.config.schema import AcceleratorConfig
from tests.launch_utils import PUSHT_SLICE, REPO, run_train
from tests.tolerances import assert_same_series, assert_same_weights, weight_mismatches

if TYPE_CHECKING:
    from tests.dist.conftest import Run

pytestmark = pytest.mark.dist

NUM_UPDATES, LR = 6, 1e-4  # every compared run makes 6 optimizer updates at this learning rate

TOPOLOGY = {
    "single_b8": "topology: single process (world size 1)",
    "single_b16": "topology: single process (world size 1)",
    "ddp_b4": "topology: DDP: 2 replicas (world size 2)",
    "fsdp_b4": "topology: FSDP2: 2 shards (world size 2)",
    "hsdp_b4": "topology: HSDP: 2 replicas x 2 shards (mesh dp_replicate x dp_shard) (world size 4)",
    "ddp_b2_accum2": "topology: DDP: 2 replicas (world size 2)",
    "fsdp_b2_accum2": "topology: FSDP2: 2 shards (world size 2)",
    "hsdp_b2_accum2": "topology: HSDP: 2 replicas x 2 shards (mesh dp_replicate x dp_shard) (world size 4)",
}
BATCH = {
    "single_b8": "batch: batch_size 8 x dp_world_size 1 x grad_accum 1 = effective batch 8",
    "single_b16": "batch: batch_size 16 x dp_world_size 1 x grad_accum 1 = effective batch 16",
    "ddp_b4": "batch: batch_size 4 x dp_world_size 2 x grad_accum 1 = effective batch 8",
    "fsdp_b4": "batch: batch_size 4 x dp_world_size 2 x grad_accum 1 = effective batch 8",
    "hsdp_b4": "batch: batch_size 4 x dp_world_size 4 x grad_accum 1 = effective batch 16",
    "ddp_b2_accum2": "batch: batch_size 2 x dp_world_size 2 x grad_accum 2 = effective batch 8",
    "fsdp_b2_accum2": "batch: batch_size 2 x dp_world_size 2 x grad_accum 2 = effective batch 8",
    "hsdp_b2_accum2": "batch: batch_size 2 x dp_world_size 4 x grad_accum 2 = effective batch 16",
}


def _series(run: Run, key: str) -> list[float]:
    return [record[key] for record in run.metrics()]


def _assert_same_training(run: Run, reference: Run) -> None:
    """Loss and gradient norm at every optimizer update, then the final weights. The k-th logged value was
    computed after k - 1 updates."""
    metrics, expected = run.metrics(), reference.metrics()
    updates_before = list(range(len(expected)))
    for key in ("loss", "grad_norm"):
        assert_same_series([m[key] for m in metrics], [m[key] for m in expected], updates_before, key)
    assert_same_weights(run.weights(), reference.weights(), NUM_UPDATES, LR)


def _assert_banner(run: Run, name: str) -> None:
    lines = [line.strip() for line in run.stdout.splitlines()]
    assert TOPOLOGY[name] in lines and BATCH[name] in lines, run.stdout[-3000:]
    # Only the main process prints the banner.
    assert sum(line.startswith("lerobot_mg train:") for line in lines) == 1


@pytest.mark.parametrize(
    ("name", "reference"),
    [("ddp_b4", "single_b8"), ("fsdp_b4", "single_b8"), ("hsdp_b4", "single_b16")],
)
def test_layout_matches_one_process(layout_run: Callable[[str], Run], name: str, reference: str) -> None:
    run, single = layout_run(name), layout_run(reference)
    _assert_banner(run, name)
    _assert_banner(single, reference)

    assert _series(run, "step") == _series(single, "step") == [1, 2, 3, 4, 5, 6]
    # The loss moved: the comparison is about training, not six identical initial losses.
    assert len({round(v, 4) for v in _series(single, "loss")}) == 6
    # The loaders delivered the same global batches, update by update (the ledger's per-update digests).
    assert run.digests() == single.digests() and len(set(single.digests())) == 6
    _assert_same_training(run, single)


@pytest.mark.parametrize(
    ("name", "reference"),
    [("ddp_b2_accum2", "ddp_b4"), ("fsdp_b2_accum2", "fsdp_b4"), ("hsdp_b2_accum2", "hsdp_b4")],
)
def test_accumulation_matches_a_bigger_batch(layout_run: Callable[[str], Run], name: str, reference: str) -> None:
    """batch_size b x accum 2 = batch_size 2b x accum 1: same updates, same weights."""
    run, big_batch = layout_run(name), layout_run(reference)
    _assert_banner(run, name)

    metrics, expected = run.metrics(), big_batch.metrics()
    # Logged every second loop step = once per optimizer update, which the big-batch run does every step.
    assert [m["step"] for m in metrics] == [2 * m["step"] for m in expected]
    for key in ("optimizer_updates", "samples_seen"):
        assert [m[key] for m in metrics] == [m[key] for m in expected], key
    assert run.digests() == big_batch.digests() and len(set(big_batch.digests())) == 6
    # The interval loss averages the update's two micro-batches: the big batch's loss. A missing 1/accum scaling
    # would double the gradient norm.
    _assert_same_training(run, big_batch)


def test_metrics_are_reduced_across_ranks(layout_run: Callable[[str], Run]) -> None:
    """4 ranks x batch 4: samples count cluster-wide, once each (not per rank, not 4 x 4 times)."""
    run = layout_run("hsdp_b4")
    metrics = run.metrics()
    assert [m["samples_seen"] for m in metrics] == [16 * m["step"] for m in metrics]
    assert [m["optimizer_updates"] for m in metrics] == [m["step"] for m in metrics]

    # The sample count the ranks sum in the log steps' reduction (the same all-reduce that gives samples/s), per
    # optimizer update: 16 when cluster-wide; 4 if one rank's count were logged, 64 if the ranks double counted.
    # Counted, not timed: samples/s divides it by a wall time, which is the machine's.
    assert [update.num_samples for update in read_ledger(run.output_dir).updates] == [16] * 6

    # The loss logged is the ranks' average, hence the one-process loss of the same 16 samples.
    single = _series(layout_run("single_b16"), "loss")
    assert_same_series([m["loss"] for m in metrics], single, list(range(len(single))), "loss")


def test_the_tolerances_reject_another_global_batch(layout_run: Callable[[str], Run]) -> None:
    """The negative control of the comparison above: DDP-2 with global batch 8 against one process with 16
    (other samples from the first update on) fails on the first loss and on most of the weights."""
    run, other = layout_run("ddp_b4"), layout_run("single_b16")
    with pytest.raises(AssertionError, match=r"loss\[0\] after 0 updates"):
        assert_same_series(_series(run, "loss"), _series(other, "loss"), list(range(NUM_UPDATES)), "loss")
    problems = weight_mismatches(run.weights(), other.weights(), NUM_UPDATES, LR)
    assert len(problems) > 10, problems


# Builds the real pieces the trainer uses (factory, wrap units, policy) and prints what the trainer cannot show:
# the device mesh, the FSDP units and each parameter's local shard.
FACTS_SCRIPT = """
import json, sys
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.config.schema import AcceleratorConfig
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.distributed.accelerator import build_accelerator, launch_world, prepare_units
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.config.act import ACTConfig
from lerobot_mg.distributed.wrap import plan_units
from lerobot_mg.policies.registry import make_policy

dp_replicate, dp_shard, root, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
world_size, rank, local_rank = launch_world()
dims = ParallelDims.resolve(dp_replicate, dp_shard, world_size, rank, local_rank)
acc_cfg = AcceleratorConfig()
torch.manual_seed(0)
accelerator = build_accelerator(acc_cfg, dims)
features = LeRobotDataset(root, delta_timestamps={"action": [0.0]}).features
policy = make_policy(ACTConfig(observation_keys=["observation.state"], chunk_size=1, n_action_steps=1, dim_model=64,
                               n_heads=4, dim_feedforward=128, n_encoder_layers=2, n_vae_encoder_layers=2), features)
full = {n: list(p.shape) for n, p in policy.named_parameters()}
block_units = sorted(n for n, m in policy.named_modules() if type(m).__name__ in policy._fsdp_wrap_modules)
units = [name for name, _ in plan_units(policy, acc_cfg, dims.is_sharded).units]
prepare_units(accelerator, policy, acc_cfg, dims)
model, _ = accelerator.prepare(policy, torch.optim.AdamW(policy.parameters()))
mesh = accelerator.torch_device_mesh
fsdp_mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
params = {}
for name, p in model.named_parameters():
    local = p.to_local() if isinstance(p, DTensor) else p
    params[name] = {
        "full_shape": full[name], "local_numel": local.numel(), "local_sum": float(local.detach().double().sum()),
        "dtensor": isinstance(p, DTensor),
        "placements": [f"Shard({x.dim})" if x.is_shard() else "Replicate" if x.is_replicate() else str(x)
                       for x in p.placements] if isinstance(p, DTensor) else [],
        "mesh_shape": list(p.device_mesh.mesh.shape) if isinstance(p, DTensor) else [],
    }
# One file per rank: lines that ranks print at the same time can interleave in the shared pipe.
open(f"{out_dir}/facts_rank{rank}.json", "w").write(json.dumps({
    "rank": rank,
    "distributed_type": str(accelerator.distributed_type),
    "is_fsdp2": accelerator.is_fsdp2,
    "mesh_dim_names": list(mesh.mesh_dim_names),
    "fsdp_dim_names": list(fsdp_mesh.mesh_dim_names),
    "fsdp_mesh": fsdp_mesh.mesh.tolist(),
    "units": sorted(units),
    "block_units": block_units,
    "fsdp_modules": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
    "params": params,
    # The timeout of every process group of the mesh (torch creates HSDP's subgroups with its own default).
    "group_timeouts_s": sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                                for g in [*mesh.get_all_groups(), torch.distributed.group.WORLD]}),
    # Each group's backend per device type: the mesh's groups inherit the default group's map.
    "default_group_backends": torch.distributed.get_backend_config(),
    "mesh_group_backends": sorted({torch.distributed.get_backend_config(g) for g in mesh.get_all_groups()}),
}))
# No rank leaves before every rank is done: rank 0 hosts the rendezvous store, and the ranks that need no peer to
# create a mesh group (0 and 1 are in neither of HSDP's [2, 3] groups) would otherwise race ahead and exit while
# ranks 2 and 3 still connect theirs through it (a training run ends with such a barrier too).
torch.distributed.barrier()
"""


def _sharding_facts(tmp_path: Path, nproc: int, dp_replicate: int, dp_shard: int) -> dict[int, dict]:
    script = tmp_path / "facts.py"
    script.write_text(FACTS_SCRIPT)
    out_dir = tmp_path / "facts"
    out_dir.mkdir()
    proc = run_train([str(dp_replicate), str(dp_shard), str(PUSHT_SLICE), str(out_dir)], nproc=nproc, script=script,
                     timeout=300, env={"PYTHONPATH": str(REPO)})
    facts = [json.loads(path.read_text()) for path in sorted(out_dir.glob("facts_rank*.json"))]
    assert sorted(f["rank"] for f in facts) == list(range(nproc)), proc.stdout[-6000:]
    return {f["rank"]: f for f in facts}


def _full_numel(shape: list[int]) -> int:
    return int(torch.Size(shape).numel())


def _assert_units(facts: dict) -> None:
    assert facts["distributed_type"] == "DistributedType.FSDP" and facts["is_fsdp2"]
    # The policy's declared blocks are the units; accelerate adds the root and nothing else.
    assert facts["units"] == facts["block_units"] and len(facts["units"]) == 5  # 2 VAE + 2 encoder + 1 decoder
    assert facts["fsdp_modules"] == sorted(["", *facts["units"]])


def test_fsdp2_shards_every_parameter_over_two_ranks(tmp_path: Path) -> None:
    facts = _sharding_facts(tmp_path, nproc=2, dp_replicate=1, dp_shard=2)
    for rank_facts in facts.values():
        _assert_units(rank_facts)
        assert rank_facts["fsdp_dim_names"] == ["dp_shard_cp"] and rank_facts["fsdp_mesh"] == [0, 1]

    params0, params1 = facts[0]["params"], facts[1]["params"]
    for name, p0 in params0.items():
        p1 = params1[name]
        assert p0["dtensor"] and p0["placements"] == ["Shard(0)"] and p0["mesh_shape"] == [2], (name, p0)
        # Dim 0 is split in two: rank 0 holds ceil(d0 / 2) rows, rank 1 the rest; together exactly the tensor.
        full_numel, rows = _full_numel(p0["full_shape"]), p0["full_shape"][0]
        assert p0["local_numel"] + p1["local_numel"] == full_numel, name
        assert p0["local_numel"] == -(-rows // 2) * (full_numel // rows), name
    total = sum(_full_numel(p["full_shape"]) for p in params0.values())
    local0 = sum(p["local_numel"] for p in params0.values())
    assert 0.45 * total < local0 < 0.55 * total and total > 100_000


def test_hsdp_mesh_is_two_replicas_of_two_shards(tmp_path: Path) -> None:
    facts = _sharding_facts(tmp_path, nproc=4, dp_replicate=2, dp_shard=2)
    for rank_facts in facts.values():
        _assert_units(rank_facts)
        assert rank_facts["fsdp_dim_names"] == ["dp_replicate", "dp_shard_cp"]
        assert rank_facts["fsdp_mesh"] == [[0, 1], [2, 3]]  # rows: replicas, columns: shards
        assert {"dp_replicate", "dp_shard"} <= set(rank_facts["mesh_dim_names"])
        # accelerator.process_group_timeout_s reaches the replicate and shard groups, not only the default group.
        assert rank_facts["group_timeouts_s"] == [AcceleratorConfig().process_group_timeout_s]
        # ... and so does the default group's backend map (docs/launching.md, "Collectives and backends").
        assert rank_facts["default_group_backends"] == "cpu:gloo,cuda:gloo"
        assert rank_facts["mesh_group_backends"] == [rank_facts["default_group_backends"]]

    for name, p0 in facts[0]["params"].items():
        assert p0["placements"] == ["Replicate", "Shard(0)"] and p0["mesh_shape"] == [2, 2], (name, p0)
        # Sharded over 2 ranks, not 4: a shard and its other half make the whole tensor.
        assert p0["local_numel"] + facts[1]["params"][name]["local_numel"] == _full_numel(p0["full_shape"]), name
        # Ranks 0 and 2 are replicas of the same shard: same size and the same values.
        p2 = facts[2]["params"][name]
        assert (p2["local_numel"], p2["local_sum"]) == (p0["local_numel"], p0["local_sum"]), name
