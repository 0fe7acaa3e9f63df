"""The runtime topology: the one object that knows degrees, ranks and the layout name."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lerobot_mg.config.validate import resolve_dp_degrees


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    rank: int
    local_rank: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, world_size: int, rank: int = 0, local_rank: int = 0):
        replicate, shard = resolve_dp_degrees(dp_replicate, dp_shard, world_size)
        return cls(replicate, shard, world_size, rank, local_rank)

    @property
    def dp_world_size(self) -> int:
        """Data-parallel workers: every rank loads its own micro-batch in all three layouts."""
        return self.dp_replicate * self.dp_shard

    @property
    def is_sharded(self) -> bool:
        return self.dp_shard > 1

    @property
    def is_hsdp(self) -> bool:
        return self.is_sharded and self.dp_replicate > 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def layout(self) -> str:
        if self.is_hsdp:
            return "hsdp"
        if self.is_sharded:
            return "fsdp"
        return "ddp" if self.is_distributed else "single"

    def describe(self) -> str:
        if self.layout == "hsdp":
            return f"HSDP: {self.dp_replicate} replicas x {self.dp_shard} shards (mesh dp_replicate x dp_shard)"
        if self.layout == "fsdp":
            return f"FSDP2: {self.dp_shard} shards"
        if self.layout == "ddp":
            return f"DDP: {self.world_size} replicas"
        return "single process"

    def to_dict(self) -> dict:
        """The saveable topology (no ranks: they describe a process, not the run)."""
        d = asdict(self)
        del d["rank"], d["local_rank"]
        d["layout"] = self.layout
        d["dp_world_size"] = self.dp_world_size
        return d
