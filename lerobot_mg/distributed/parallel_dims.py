"""The runtime topology (degrees, ranks, layout) and the batch arithmetic it implies.

``parallelism.dp_shard`` left unset means "not sharded": DDP over every process the launcher started. Any value
typed (``N``, or ``-1`` for all processes) asks for sharding. A shard degree of 1 on several processes is plain
replication (DDP); on one process started by a launcher it is FSDP2 on a 1-rank mesh, which runs every collective
and checkpoint path of a sharded run on a single GPU. A process started without a launcher (plain ``python``) is
one process with no process group, whatever the config asks.

``effective_batch_size`` is a derived field (``init=False``): computed on construction, written with
``dataclasses.asdict`` so readers of the JSON records see it, and never read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from lerobot_mg.errors import config_error


class Layout(str, Enum):
    """How the model is laid out over the processes of a run."""

    SINGLE = "single"  # one process started without a launcher: no process group
    DDP = "ddp"  # every process holds a full replica (one launched process: a 1-rank process group)
    FSDP = "fsdp"  # parameters, gradients and optimizer state sharded over every process (1-rank mesh on one)
    HSDP = "hsdp"  # sharded within groups of dp_shard ranks, the groups replicated dp_replicate times

    @property
    def sharded(self) -> bool:
        return self in (Layout.FSDP, Layout.HSDP)

    @property
    def distributed(self) -> bool:
        """A process group exists (the launcher started the run, even on one process)."""
        return self is not Layout.SINGLE


@dataclass(frozen=True)
class Topology:
    """The saveable topology of a run (no ranks: they describe a process, not the run).

    ``layout`` left None is derived from the degrees as runs written before 1-rank distributed layouts existed
    did (sharded when ``dp_shard > 1``, distributed when ``world_size > 1``): records those runs saved read back
    unchanged. :meth:`ParallelDims.resolve` always sets it.
    """

    dp_replicate: int
    dp_shard: int
    world_size: int
    layout: Layout | None = None

    def __post_init__(self) -> None:
        if self.layout is None:
            sharded, replicated = self.dp_shard > 1, self.dp_replicate > 1
            layout = (Layout.HSDP if sharded and replicated else Layout.FSDP if sharded
                      else Layout.DDP if self.world_size > 1 else Layout.SINGLE)
        else:
            layout = Layout(self.layout)
        object.__setattr__(self, "layout", layout)

    @property
    def dp_world_size(self) -> int:
        """Data-parallel workers: every rank loads its own micro-batch in all three layouts."""
        return self.dp_replicate * self.dp_shard

    @property
    def is_sharded(self) -> bool:
        return self.layout.sharded

    @property
    def is_distributed(self) -> bool:
        return self.layout.distributed

    def describe(self) -> str:
        if self.layout is Layout.HSDP:
            return f"HSDP: {self.dp_replicate} replicas x {self.dp_shard} shards (mesh dp_replicate x dp_shard)"
        if self.layout is Layout.FSDP:
            return "FSDP2: 1 shard (a 1-rank mesh)" if self.dp_shard == 1 else f"FSDP2: {self.dp_shard} shards"
        if self.layout is Layout.DDP:
            return "DDP: 1 replica (a 1-rank process group)" if self.world_size == 1 else f"DDP: {self.world_size} replicas"
        return "single process"


def resolve_dp_degrees(dp_replicate: int, dp_shard: int | None, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) actually used on ``world_size`` processes; raises on an impossible layout.

    ``dp_shard`` unset (None), or both 1, means DDP: every process is a replica. ``dp_shard=-1`` shards over all
    processes left after ``dp_replicate``.
    """
    if dp_replicate < 1:
        raise config_error("parallelism.dp_replicate", dp_replicate, "must be >= 1", "parallelism.dp_replicate=1")
    if dp_shard is not None and (dp_shard == 0 or dp_shard < -1):
        raise config_error(
            "parallelism.dp_shard", dp_shard, "must be >= 1, or -1 for all processes", "parallelism.dp_shard=-1"
        )
    if dp_replicate == 1 and dp_shard in (None, 1):
        return world_size, 1
    if dp_shard == -1:
        if world_size % dp_replicate:
            raise config_error(
                "parallelism.dp_replicate",
                dp_replicate,
                f"does not divide the {world_size} processes the launcher started (dp_shard=-1 shards over "
                f"world_size / dp_replicate)",
                f"parallelism.dp_replicate=<a divisor of {world_size}>",
            )
        if dp_replicate > 1 and world_size == dp_replicate:
            raise config_error(
                "parallelism.dp_shard", dp_shard,
                f"shards over world_size / dp_replicate = {world_size} / {dp_replicate} = 1 rank: that is plain "
                "replication (DDP), not HSDP",
                f"launch {2 * dp_replicate}+ processes for HSDP, or parallelism=ddp for DDP",
            )
        return dp_replicate, world_size // dp_replicate
    shard = 1 if dp_shard is None else dp_shard
    if dp_replicate * shard != world_size:
        raise config_error(
            "parallelism",
            {"dp_replicate": dp_replicate, "dp_shard": dp_shard},
            f"dp_replicate x dp_shard = {dp_replicate * shard} but the launcher started {world_size} "
            f"process(es); the two degrees must multiply to the world size",
            f"parallelism.dp_shard=-1 (shard over all processes), or launch {dp_replicate * shard} processes "
            f"(torchrun --nproc-per-node=...)",
        )
    return dp_replicate, shard


def resolve_layout(dp_shard: int | None, degrees: tuple[int, int], world_size: int, launched: bool) -> Layout:
    """The layout of the resolved ``degrees`` (dp_replicate, dp_shard) on ``world_size`` processes.

    ``launched``: a launcher (torchrun, accelerate launch, SLURM) started the processes; several processes always
    were. A typed ``dp_shard`` shards; on one launched process that is FSDP2 on a 1-rank mesh.
    """
    replicate, shard = degrees
    if not (launched or world_size > 1):
        return Layout.SINGLE
    if shard > 1:
        return Layout.HSDP if replicate > 1 else Layout.FSDP
    if dp_shard is not None and world_size == 1:
        return Layout.FSDP
    return Layout.DDP


@dataclass(frozen=True)
class ParallelDims(Topology):
    """The one object that knows degrees and ranks; the loop asks it questions instead of doing rank arithmetic."""

    rank: int = 0
    local_rank: int = 0

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int | None, world_size: int, rank: int = 0,
                local_rank: int = 0, launched: bool = False) -> ParallelDims:
        """The layout of ``parallelism.*`` on ``world_size`` processes; ``launched``: see :func:`resolve_layout`."""
        degrees = resolve_dp_degrees(dp_replicate, dp_shard, world_size)
        return cls(*degrees, world_size, resolve_layout(dp_shard, degrees, world_size, launched), rank, local_rank)

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def topology(self) -> Topology:
        return Topology(self.dp_replicate, self.dp_shard, self.world_size, self.layout)


@dataclass(frozen=True)
class BatchArithmetic:
    """The guide's batch arithmetic: each of ``dp_world_size`` workers loads a ``batch_size`` micro-batch per
    loop step; ``grad_accum_steps`` loop steps make one optimizer update of ``effective_batch_size`` samples."""

    batch_size: int
    dp_world_size: int
    grad_accum_steps: int
    effective_batch_size: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("batch_size", "dp_world_size", "grad_accum_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchArithmetic.{name} must be a positive integer, got {value!r}.")
        object.__setattr__(self, "effective_batch_size", self.samples_per_loop_step * self.grad_accum_steps)

    @property
    def samples_per_loop_step(self) -> int:
        return self.batch_size * self.dp_world_size

    def describe(self) -> str:
        return (f"batch_size {self.batch_size} x dp_world_size {self.dp_world_size} x grad_accum "
                f"{self.grad_accum_steps} = effective batch {self.effective_batch_size}")

    def sample_presentations(self, loop_steps: int) -> int:
        """Samples drawn over ``loop_steps`` loop steps (full micro-batches: the sampler drops the last)."""
        if loop_steps < 0:
            raise ValueError(f"loop_steps must be >= 0, got {loop_steps}.")
        return loop_steps * self.samples_per_loop_step

    def optimizer_updates(self, loop_steps: int) -> int:
        """Optimizer updates completed over ``loop_steps`` loop steps (a partial accumulation is not one)."""
        return self.sample_presentations(loop_steps) // self.effective_batch_size


class Continuation(str, Enum):
    """How exactly a resumed run continues the sample stream of the run it resumes (docs/batches.md).

    The sampler's state is a position in one global stream; what a resume keeps depends on the batch arithmetic
    before and after it. Members are ordered best first.
    """

    # Same batch_size, dp_world_size and grad_accum_steps: every rank sees the samples it would have seen.
    SAMPLE_EXACT = "sample-exact"
    # Same global batch per loop step and same accumulation, split over ranks differently: every optimizer
    # update sees the same samples in the same order, but each rank sees others than before.
    GLOBAL_BATCH_EXACT = "global-batch-exact"
    # The global batch or the accumulation changed: the stream resumes at the same position, but update
    # boundaries (and the samples dropped at each epoch's end) differ from the original run.
    NOT_EXACT = "not-exact"

    @classmethod
    def of_resume(cls, before: BatchArithmetic, after: BatchArithmetic) -> Continuation:
        if before == after:
            return cls.SAMPLE_EXACT
        same_updates = before.grad_accum_steps == after.grad_accum_steps
        if same_updates and before.samples_per_loop_step == after.samples_per_loop_step:
            return cls.GLOBAL_BATCH_EXACT
        return cls.NOT_EXACT

    def describe(self) -> str:
        return {
            "sample-exact": "every rank sees the samples it would have seen",
            "global-batch-exact": "every optimizer update sees the same samples in the same order, split over the "
                                  "ranks differently",
            "not-exact": "the stream continues at the same position, but optimizer updates group its samples "
                         "differently",
        }[self.value]
