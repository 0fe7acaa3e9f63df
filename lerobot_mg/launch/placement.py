"""Where the ranks of a run landed, and whether the mesh follows the guide: shard within each node, replicate
across nodes.

FSDP all-gathers parameters and reduce-scatters gradients inside a shard group at every step; HSDP replicas
only all-reduce gradients. A shard group that spans nodes puts the heavy traffic on the slow inter-node link.
Each rank reports its node (the launcher's node rank: torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``), the
main process writes ``placement.json`` next to the ledger and says in the log how the mesh maps onto nodes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator

from lerobot_mg.distributed.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

PLACEMENT_FILENAME = "placement.json"


def node_rank() -> int:
    """This process's node index from its launcher (0 when it names none)."""
    return int(os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or 0)


@dataclass(frozen=True)
class Placement:
    node_of_rank: list[int]  # index: global rank
    host_of_rank: list[str]
    shard_groups: list[list[int]]  # ranks that split one copy of the parameters among themselves
    replicate_groups: list[list[int]]  # ranks that hold the same shard and all-reduce its gradients

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of_rank))

    @property
    def shard_groups_within_nodes(self) -> bool:
        return all(len({self.node_of_rank[r] for r in group}) == 1 for group in self.shard_groups)

    @property
    def replication_across_nodes(self) -> bool:
        """Every replicate group spans as many nodes as it has members (one replica per node)."""
        return all(len({self.node_of_rank[r] for r in group}) == len(group) for group in self.replicate_groups)

    def to_dict(self) -> dict:
        return {**asdict(self), "num_nodes": self.num_nodes,
                "shard_groups_within_nodes": self.shard_groups_within_nodes,
                "replication_across_nodes": self.replication_across_nodes}


def mesh_groups(accelerator: Accelerator, dims: ParallelDims) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups) as global ranks, read from the device mesh accelerate built."""
    if not dims.is_sharded:  # DDP: every rank holds everything
        return [], [list(range(dims.world_size))]
    mesh = accelerator.torch_device_mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)].mesh
    rows = mesh.reshape(-1, dims.dp_shard).tolist()  # (dp_replicate, dp_shard): a row is one shard group
    return rows, [list(column) for column in zip(*rows)]


def record_placement(accelerator: Accelerator, dims: ParallelDims, output_dir: Path) -> None:
    """Gather every rank's node and write ``placement.json`` (main process; nothing on one process).
    Collective: every rank must call it."""
    if not dims.is_distributed:
        return
    mine = (node_rank(), socket.gethostname())
    gathered: list[tuple[int, str] | None] = [None] * dims.world_size
    dist.all_gather_object(gathered, mine)
    if not dims.is_main_process:
        return
    shard_groups, replicate_groups = mesh_groups(accelerator, dims)
    placement = Placement([g[0] for g in gathered], [g[1] for g in gathered], shard_groups,  # type: ignore[index]
                          replicate_groups)
    (Path(output_dir) / PLACEMENT_FILENAME).write_text(json.dumps(placement.to_dict(), indent=1) + "\n")
    if placement.num_nodes > 1:
        (logger.info if placement.shard_groups_within_nodes else logger.warning)(
            "placement on %d nodes: shard groups %s %s; replicate groups %s %s", placement.num_nodes,
            shard_groups, "each within one node" if placement.shard_groups_within_nodes else
            "SPAN NODES (FSDP traffic crosses the inter-node link; shard within a node: parallelism.dp_shard = "
            "ranks per node)", replicate_groups,
            "across nodes" if placement.replication_across_nodes else "not one replica per node",
        )
