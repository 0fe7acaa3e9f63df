"""Bytes each rank holds for training: its parameter shards, their gradients, its optimizer state and, with
``ema.enable``, the moving average of its trainable shards.

Two sides of one account. :func:`rank_bytes` measures them on a prepared model (``rank_bytes.json`` at the end of a
run); :func:`plan_memory` predicts them before anything exists, from a parameter-less (meta-device) copy of the
policy and the layout, so a run that cannot fit is refused at start-up (:func:`check_fits`) and ``plan=true``
prints the plan, whether it fits (:func:`fit_verdict`), and exits. ``plan_world_size=N`` plans a world of N ranks
from one process: the arithmetic needs no process group.

What the plan counts, per rank, as the trainer builds it:

- parameters: under FSDP2/HSDP every parameter outside ``accelerator.fsdp.ignored_modules`` is split along its
  first dimension over the ``dp_shard`` ranks of its shard group (``torch.chunk``: the first ranks get
  ``ceil(rows / dp_shard)`` rows, the last may get fewer); DDP and one process hold every parameter whole. Mixed
  precision on a sharded run keeps fp32 master copies of the trainable parameters (``_upcast_trainable``);
- gradients: one per trainable element, in the parameter's dtype (what backward allocates);
- optimizer state: AdamW's two moments per trainable element, plus its 4-byte step counter per parameter;
- EMA (``ema.enable``): one average per trainable element, a clone of the parameter's shard (lerobot_mg/ema.py), so
  under FSDP2/HSDP a rank holds 1/dp_shard of what a DDP rank holds.

Mixed precision does not shrink any of them (the master weights, their gradients, the moments and the EMA stay fp32);
it shrinks activations and the gathered copy of a unit during its forward.

Beyond that persistent state, the plan also counts per rank what a step or an evaluation holds for a while
(:class:`TransientBytes`):

- gathered at the peak (sharded runs): FSDP2 keeps the root unit (parameters outside every unit) gathered from the
  first forward to the end of backward, with its unsharded gradients, and holds two units at once (the one
  computing and the next, prefetched) plus one unit's unsharded gradients before their reduce-scatter, all in the
  compute dtype (``bf16``/``fp16`` under mixed precision). The largest unit decides; a joint unit counts both of
  its layers. Units of unused parameters are never gathered. Under DDP (more than one process, or one under a
  launcher) the same line counts the reducer's buckets, a second copy of the trainable gradients;
- activations, an estimate: the bytes autograd saves for backward in one forward of ``batch_size`` samples (each
  saved storage once, parameters left out), measured by running the policy's ``example_batch`` through a meta-device
  copy of it (no memory, no computation), fp32 tensors at the compute dtype's size under mixed precision; with
  activation checkpointing the checkpointed blocks keep nothing but one block is recomputed at a time. A policy
  without ``example_batch`` gets no estimate;
- the evaluation copy: an unsharded layout evaluates a full copy of the weights (one per rank); a sharded one
  evaluates through the sharded model, one unit gathered at a time, and holds at most the shards the EMA's averages
  are swapped in for (``ema.use_for_eval``);
- the accumulation window (``gradient_accumulation.steps`` > 1): gradients stay in ``.grad`` (sharded under
  FSDP2/HSDP: every micro-batch reduce-scatters); HSDP also keeps this rank's reduce-scattered shard of the window
  until the replica all-reduce of its last micro-batch.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.distributed.device import use_cpu
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Layout, ParallelDims, Topology
from lerobot_mg.distributed.wrap import UnitPlan, freeze_unused, plan_units
from lerobot_mg.errors import config_error

ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, each the size of its parameter
ADAMW_STEP_BYTES = 4  # AdamW's per-parameter step counter: a float32 scalar tensor


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds for training, in bytes."""

    parameters: int  # frozen and trainable
    trainable_parameters: int
    optimizer_state: int
    ema: int = 0  # the moving average of the trainable parameters (ema.enable)
    gradients: int = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        # One trainable element, one gradient element of the same dtype (as backward allocates them).
        object.__setattr__(self, "gradients", self.trainable_parameters)
        object.__setattr__(self, "total", self.parameters + self.gradients + self.optimizer_state + self.ema)

    def components(self) -> str:
        """``parameters X + gradients Y + optimizer state Z [+ EMA W]`` in GiB (the fit verdict's words)."""
        gib = 2**30
        return (f"parameters {self.parameters / gib:.2f} + gradients {self.gradients / gib:.2f} + optimizer state "
                f"{self.optimizer_state / gib:.2f}" + (f" + EMA {self.ema / gib:.2f}" if self.ema else ""))


def _local_bytes(tensor: Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               ema: Iterable[Tensor] | None = None) -> dict[str, int]:
    """This rank's parameter bytes (frozen and trainable), gradient bytes, optimizer-state bytes (after the
    first update) and EMA bytes (``ema``: the averages, lerobot_mg.ema.ModelEMA), measured on the prepared model: a
    dict of :class:`RankBytes` fields."""
    params = list(model.parameters())
    optimizer_state = 0
    if optimizer is not None:
        optimizer_state = sum(
            _local_bytes(value) for state in optimizer.state.values() for value in state.values()
            if isinstance(value, Tensor)
        )
    return asdict(RankBytes(
        parameters=sum(_local_bytes(p) for p in params),
        trainable_parameters=sum(_local_bytes(p) for p in params if p.requires_grad),
        optimizer_state=optimizer_state,
        ema=sum(_local_bytes(average) for average in ema or ()),
    ))


def gather_rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                      ema: Iterable[Tensor] | None = None) -> list[dict[str, Any]]:
    """:func:`rank_bytes` of every rank, in rank order. Collective: every rank must call it."""
    mine = rank_bytes(model, optimizer, ema)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


# --- the plan: the same account before anything exists ---------------------------------------------------------


@dataclass(frozen=True)
class ParamFact:
    """What the plan needs of one parameter of the policy."""

    rows: int  # size of the first dimension, the one FSDP2 shards (1 for a scalar)
    row_numel: int  # elements per row
    element_size: int
    trainable: bool
    sharded: bool  # False for parameters of accelerator.fsdp.ignored_modules


def param_facts(model: nn.Module, ignored_modules: str | None) -> list[ParamFact]:
    """One :class:`ParamFact` per parameter of ``model`` (a meta-device copy is enough)."""
    ignored: set[int] = set()
    if ignored_modules is not None:  # the same full-path regex accelerate applies (see FSDPConfig.ignored_modules)
        pattern = re.compile(ignored_modules)
        for name, module in model.named_modules():
            if pattern.fullmatch(name):
                ignored.update(id(p) for p in module.parameters())
    facts = []
    for param in model.parameters():
        shape = tuple(param.shape) or (1,)
        facts.append(ParamFact(shape[0], math.prod(shape[1:]), param.element_size(), param.requires_grad,
                               id(param) not in ignored))
    return facts


def _shard_rows(rows: int, dp_shard: int, shard_index: int) -> int:
    """Rows of a ``rows``-row parameter on shard ``shard_index`` of ``dp_shard`` (``torch.chunk``, as FSDP2)."""
    chunk = -(-rows // dp_shard)
    return max(0, min(chunk, rows - shard_index * chunk))


def planned_rank_bytes(facts: list[ParamFact], dp_shard: int, shard_index: int, upcast_trainable: bool,
                       ema: bool = False) -> RankBytes:
    """:class:`RankBytes` of the rank at ``shard_index`` of a shard group of ``dp_shard`` ranks (1: unsharded);
    ``ema``: with the moving average of the trainable shards."""
    parameters = trainable = moments = 0
    for fact in facts:
        rows = _shard_rows(fact.rows, dp_shard, shard_index) if fact.sharded and dp_shard > 1 else fact.rows
        numel = rows * fact.row_numel
        size = 4 if fact.trainable and upcast_trainable else fact.element_size
        parameters += numel * size
        if fact.trainable:
            trainable += numel * size
            moments += ADAMW_MOMENTS * numel * size + ADAMW_STEP_BYTES
    return RankBytes(parameters=parameters, trainable_parameters=trainable, optimizer_state=moments,
                     ema=trainable if ema else 0)


@dataclass(frozen=True)
class LayoutOption:
    """A layout of the same world size and what its busiest rank holds where."""

    dp_replicate: int
    dp_shard: int
    cpu_offload: bool
    per_rank: RankBytes

    def override(self) -> str:
        return (f"parallelism.dp_replicate={self.dp_replicate} parallelism.dp_shard={self.dp_shard}"
                + (" accelerator.fsdp.cpu_offload=true" if self.cpu_offload else ""))


@dataclass(frozen=True)
class MemoryBudget:
    """The memory the state of this node's ranks must fit in."""

    free_bytes: int
    what: str  # e.g. "free memory of cuda:0", "available host RAM"
    ranks_sharing: int  # ranks of this node that draw on it (host RAM: every local rank; a GPU: one)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes of the composed layout, and what else the plan=true printout reports."""

    topology: Topology
    per_rank: tuple[RankBytes, ...]  # rank order
    gpu: bool  # the run trains on GPUs
    cpu_offload: bool  # accelerator.fsdp.cpu_offload on a sharded run: the state lives in host RAM
    units: tuple[str, ...]  # FSDP wrap units (or per-unit transforms' units), bottom-up
    unit_rule: str
    batch: BatchArithmetic
    facts: tuple[ParamFact, ...]
    upcast_trainable: bool
    # What the plan=true printout checks the fit against (None: not checked, e.g. a GPU plan made without a GPU).
    budget: MemoryBudget | None = None
    ema: bool = False  # ema.enable: each rank holds the average of its trainable shards
    transient: TransientBytes | None = None  # what a step or an evaluation holds for a while, per rank
    num_parameters: int = 0  # of the policy, each tied parameter once
    joint_units: str = ""  # UnitPlan.describe()'s joint-unit line, "" without groups

    @property
    def on_device(self) -> bool:
        """The state lives in GPU memory (else in host RAM)."""
        return self.gpu and not self.cpu_offload

    @property
    def busiest(self) -> RankBytes:
        return busiest_of(self.per_rank)

    def options(self) -> list[LayoutOption]:
        """Every (dp_replicate, dp_shard) of this world size, and on a GPU each also with cpu_offload."""
        world = self.topology.world_size
        options = []
        for dp_shard in (d for d in range(1, world + 1) if world % d == 0):
            held = max((planned_rank_bytes(list(self.facts), dp_shard, s, self.upcast_trainable and dp_shard > 1,
                                           self.ema) for s in range(dp_shard)), key=lambda h: h.total)
            options.append(LayoutOption(world // dp_shard, dp_shard, False, held))
            if self.gpu and dp_shard > 1:  # FSDP2 offloads sharded state only
                options.append(LayoutOption(world // dp_shard, dp_shard, True, held))
        return options

    def describe(self) -> list[str]:
        mib = 2**20
        where = "device" if self.on_device else "host RAM"
        lines = [f"memory plan: {self.topology.describe()}; {self.batch.describe()}",
                 f"  parameters: {self.num_parameters:,}"]
        if self.joint_units:
            lines.append(f"  {self.joint_units}")
        lines.append(f"  wrap units ({self.unit_rule}): {len(self.units)}" + (f", e.g. {self.units[-1]}" if self.units
                                                                               else ""))
        # Beyond 8 ranks, the ranks that hold the same bytes share a line (not one line per rank of a large world).
        groups: dict[RankBytes, list[int]] = {}
        for rank, held in enumerate(self.per_rank):
            groups.setdefault(held, []).append(rank)
        labelled = ([(f"rank {rank}", held) for rank, held in enumerate(self.per_rank)] if len(self.per_rank) <= 8
                    else [(_rank_ranges(ranks), held) for held, ranks in groups.items()])
        lines += [f"  {label} ({where}): parameters {held.parameters / mib:.3f} MiB (trainable "
                  f"{held.trainable_parameters / mib:.3f}) + gradients {held.gradients / mib:.3f} + optimizer state "
                  f"{held.optimizer_state / mib:.3f}" + (f" + EMA {held.ema / mib:.3f}" if held.ema else "")
                  + f" = {held.total / mib:.3f} MiB" for label, held in labelled]
        if self.transient is not None:
            lines += [f"  {line}" for line in self.transient.describe()]
        if self.budget is None:
            lines.append("  fit: not checked (no GPU here to compare with): plan_device_memory_gib=<GiB of one GPU>")
        else:
            fits, problem, fix = fit_verdict(self, self.budget)
            lines.append(f"  fit: {problem}" if fits else f"  does not fit: {problem}. Layouts that fit: {fix}")
        return lines


def _rank_ranges(ranks: list[int]) -> str:
    """``ranks 0-4, 8-12, 16-20, ... (40 ranks)``: runs of consecutive ranks, the first three of them."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:3]) + (", ..." if len(runs) > 3 else "")
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}" + (f" ({len(ranks)} ranks)" if len(runs) > 1 else "")


def plan_memory(cfg: TrainConfig, dims: ParallelDims, policy: nn.Module) -> MemoryPlan:
    """The plan of ``cfg`` on the layout ``dims`` for ``policy``, the run's policy built on the meta device (no
    memory, no process group; :func:`lerobot_mg.preflight.preflight` builds it once per start)."""
    acc = cfg.accelerator
    freeze_unused(policy)  # as the trainer does before its optimizer exists (unused_parameter_names)
    units = plan_units(policy, acc, dims.is_sharded)
    upcast = dims.is_sharded and acc.mixed_precision != "no"
    facts = param_facts(policy, acc.fsdp.ignored_modules if dims.is_sharded else None)
    per_rank = tuple(planned_rank_bytes(facts, dims.dp_shard, rank % dims.dp_shard, upcast, cfg.ema.enable)
                     for rank in range(dims.world_size))
    joint = next((line for line in units.describe() if line.startswith("joint units")), "")
    return MemoryPlan(dims.topology, per_rank, not use_cpu(acc), dims.is_sharded and acc.fsdp.cpu_offload,
                      tuple(name for name, _ in units.units), units.rule,
                      BatchArithmetic(cfg.batch_size, dims.dp_world_size, acc.gradient_accumulation.steps),
                      tuple(facts), upcast, ema=cfg.ema.enable,
                      transient=transient_bytes(policy, units, cfg, dims, per_rank),
                      num_parameters=sum(p.numel() for p in policy.parameters()), joint_units=joint)


# --- what a step or an evaluation holds for a while ----------------------------------------------------------------

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def compute_bytes(cfg: TrainConfig, sharded: bool) -> int | None:
    """Bytes of one element in the forward's compute dtype under FSDP2 mixed precision (None: the parameters' own)."""
    acc = cfg.accelerator
    if not sharded or acc.mixed_precision == "no":
        return None
    param_dtype = acc.fsdp.mixed_precision_policy.param_dtype
    return _DTYPE_BYTES[param_dtype] if param_dtype is not None else 2


@dataclass(frozen=True)
class UnitSize:
    """Elements of one FSDP unit (a joint unit: of all its modules), frozen and trainable."""

    label: str
    numel: int
    trainable: int


def unit_sizes(model: nn.Module, plan: UnitPlan) -> tuple[UnitSize, list[UnitSize]]:
    """(the root unit, every other unit that a pass gathers): each parameter counted in the innermost unit that
    holds it, the units of unused parameters (never gathered) left out."""
    entries = [*plan.units, *((group.label, m) for group in plan.groups for m in group.modules), *plan.idle]
    depth = {id(module): name.count(".") for name, module in model.named_modules()}
    owner: dict[int, str] = {}
    for label, unit in sorted(entries, key=lambda item: depth.get(id(item[1]), 0)):
        for module in unit.modules():
            owner[id(module)] = label
    numel: dict[str, list[int]] = {}
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            counts = numel.setdefault(owner.get(id(module), "<root>"), [0, 0])
            counts[0] += param.numel()
            counts[1] += param.numel() if param.requires_grad else 0
    idle = {label for label, _ in plan.idle}
    root = UnitSize("<root>", *numel.pop("<root>", [0, 0]))
    return root, [UnitSize(label, *counts) for label, counts in numel.items() if label not in idle]


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes saved for backward by one forward of a micro-batch (an estimate; see the module docstring)."""

    total: int | None  # None: not estimated (``how`` says why)
    how: str


def estimate_activations(policy: nn.Module, batch_size: int, blocks: list[nn.Module],
                         element_bytes: int | None) -> ActivationEstimate | None:
    """Run ``policy.example_batch(batch_size)`` through ``policy`` (on the meta device: shapes only) and add up
    the storages autograd saves for backward, parameters left out; with ``blocks`` (the checkpointed ones), what
    each keeps inside is replaced by the largest block's (one recomputed at a time). ``element_bytes``: fp32
    tensors count at that size (mixed precision). None when the policy has no ``example_batch``."""
    make_batch = getattr(policy, "example_batch", None)
    if make_batch is None:
        return None
    params = {StorageWeakRef(p.untyped_storage()) for p in policy.parameters()}
    saved: dict[StorageWeakRef, tuple[int, int]] = {}  # storage -> (bytes, block index or -1)
    stack: list[int] = []

    def pack(tensor: Tensor) -> Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in params and ref not in saved:
            size = tensor.untyped_storage().nbytes()
            if element_bytes is not None and tensor.dtype == torch.float32:
                size = size * element_bytes // 4
            saved[ref] = (size, stack[0] if stack else -1)
        return tensor

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, index=index: stack.append(index)))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.device("meta"), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            policy(make_batch(batch_size))
    except (NotImplementedError, RuntimeError) as error:  # an op without a meta kernel, data read on the host
        return ActivationEstimate(None, f"not estimated: {type(policy).__name__}'s forward does not run on the meta "
                                        f"device ({type(error).__name__}: {str(error).splitlines()[0]})")
    finally:
        for handle in handles:
            handle.remove()
    outside = sum(size for size, block in saved.values() if block < 0)
    per_block = [sum(size for size, block in saved.values() if block == index) for index in range(len(blocks))]
    how = f"tensors saved for backward by one forward of {batch_size} samples, measured on the meta device"
    if not blocks:
        return ActivationEstimate(outside + sum(per_block), how)
    return ActivationEstimate(outside + max(per_block, default=0),
                              how + f"; {len(blocks)} checkpointed blocks keep only their inputs, one recomputed "
                              "at a time")


@dataclass(frozen=True)
class TransientBytes:
    """Per rank, what a step or an evaluation holds beyond the persistent state (bytes; the module docstring says
    how each is counted)."""

    gathered: int  # the peak of FSDP2's gathered parameters and unsharded gradients; 0 unsharded
    gathered_what: str
    activations: ActivationEstimate | None
    evaluation: int  # the evaluation copy (or the shards EMA swaps in)
    evaluation_what: str
    accumulation: int  # held for the accumulation window beyond .grad
    accumulation_what: str

    def describe(self) -> list[str]:
        mib = 2**20
        if self.activations is None:
            activations = "activations: not estimated (the policy defines no example_batch)"
        elif self.activations.total is None:
            activations = f"activations: {self.activations.how}"
        else:
            activations = f"activations (estimate): {self.activations.total / mib:.3f} MiB ({self.activations.how})"
        return [f"gathered at the peak: {self.gathered / mib:.3f} MiB ({self.gathered_what})", activations,
                f"evaluation copy: {self.evaluation / mib:.3f} MiB ({self.evaluation_what})",
                f"accumulation window: {self.accumulation / mib:.3f} MiB ({self.accumulation_what})"]


def busiest_of(per_rank: tuple[RankBytes, ...]) -> RankBytes:
    """The rank that holds the most (the one a fit is decided by)."""
    return max(per_rank, key=lambda held: held.total)


def transient_bytes(policy: nn.Module, plan: UnitPlan, cfg: TrainConfig, dims: ParallelDims,
                    per_rank: tuple[RankBytes, ...]) -> TransientBytes:
    """:class:`TransientBytes` of ``policy`` (on the meta device) sharded by ``plan`` on ``dims``."""
    element = compute_bytes(cfg, dims.is_sharded)
    param_bytes = next((p.element_size() for p in policy.parameters()), 4)
    size = element or param_bytes
    gathered, gathered_what = 0, "nothing: every rank holds the whole model"
    if dims.layout == Layout.DDP:  # the reducer's buckets are a second copy of the gradients it all-reduces
        gathered = busiest_of(per_rank).gradients
        gathered_what = "DDP's reducer buckets: a second copy of the trainable gradients"
    if dims.is_sharded:
        root, units = unit_sizes(policy, plan)
        largest = max(units, key=lambda unit: unit.numel, default=UnitSize("none", 0, 0))
        gathered = size * (root.numel + root.trainable + 2 * largest.numel + largest.trainable)
        gathered_what = (f"root unit {root.numel:,} parameters and their gradients, + 2 x the largest unit "
                         f"({largest.label}: {largest.numel:,}) and its gradients, at {size} bytes each")
    blocks = [module for _, module in plan.checkpointed]
    # Unsharded runs compute under autocast in half precision with mixed precision on.
    activation_element = element if dims.is_sharded else (2 if cfg.accelerator.mixed_precision != "no" else None)
    activations = estimate_activations(policy, cfg.batch_size, blocks, activation_element)
    evaluates = cfg.eval.n_episodes > 0 or bool(cfg.dataset.val_episodes)
    busiest = busiest_of(per_rank)
    if not evaluates:
        evaluation, evaluation_what = 0, "no evaluation configured"
    elif dims.is_sharded:
        swapped = busiest.trainable_parameters if cfg.ema.enable and cfg.ema.use_for_eval else 0
        evaluation = swapped
        evaluation_what = ("through the sharded model, one unit gathered at a time"
                           + (", the trained shards kept while the EMA's are swapped in" if swapped else ""))
    else:
        evaluation = sum(p.numel() * p.element_size() for p in policy.parameters())
        evaluation_what = "a whole copy of the weights on every rank"
    steps = cfg.accelerator.gradient_accumulation.steps
    accumulation, accumulation_what = 0, "no accumulation"
    if steps > 1:
        accumulation_what = ("the window's gradients accumulate in .grad" if not dims.is_sharded else
                             "reduce-scattered every micro-batch: each rank accumulates its shard in .grad")
        if dims.is_sharded and dims.dp_replicate > 1:
            master = 4 if element is not None else param_bytes  # mixed precision keeps fp32 masters
            accumulation = busiest.trainable_parameters // master * size  # the shard, in the reduce dtype
            accumulation_what += "; HSDP keeps the reduce-scattered shard until the replica all-reduce"
    return TransientBytes(gathered, gathered_what, activations, evaluation, evaluation_what, accumulation,
                          accumulation_what)


def memory_budget(on_device: bool, local_rank: int) -> MemoryBudget:
    """Free device memory of this rank's GPU, or the host RAM available to all of this node's ranks."""
    if on_device:
        free, _ = torch.cuda.mem_get_info(local_rank)
        return MemoryBudget(free, f"free memory of cuda:{local_rank}", 1)
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    return MemoryBudget(available, "available host RAM", int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def given_budget(gib: float) -> MemoryBudget:
    """``plan_device_memory_gib``: the memory one rank trains in (its GPU's; host RAM for a CPU or offloaded run)."""
    return MemoryBudget(int(gib * 2**30), f"plan_device_memory_gib={gib:g}", 1)


def fit_verdict(plan: MemoryPlan, budget: MemoryBudget) -> tuple[bool, str, str]:
    """(fits, what the busiest rank needs against ``budget``, the layouts of this world size that fit)."""
    need = plan.busiest.total * budget.ranks_sharing
    gib = 2**30
    fitting = [option for option in plan.options()
               if (option.cpu_offload and not plan.cpu_offload) or option.per_rank.total * budget.ranks_sharing <= budget.free_bytes]
    held = plan.busiest
    fits = need <= budget.free_bytes
    problem = (f"each rank holds {held.total / gib:.2f} GiB of training state ({held.components()}), "
               f"x {budget.ranks_sharing} rank(s) = {need / gib:.2f} GiB {'<=' if fits else '>'} {budget.what} "
               f"{budget.free_bytes / gib:.2f} GiB")
    if not fits:
        problem += "; mixed precision would not shrink it (fp32 master weights, gradients and moments)"
    fix = ("; ".join(f"{o.override()} ({o.per_rank.total / gib:.2f} GiB per rank"
                     + (", in host RAM" if o.cpu_offload else "") + ")" for o in fitting)
           or "no layout of this world size fits: more ranks (a larger dp_shard), LoRA (peft=lora) or a smaller policy")
    return fits, problem, fix


def check_fits(plan: MemoryPlan, budget: MemoryBudget) -> None:
    """Raise a ConfigError when this node's ranks would hold more than ``budget``, with the layouts that fit."""
    fits, problem, fix = fit_verdict(plan, budget)
    if not fits:
        raise config_error("parallelism.dp_shard", plan.topology.dp_shard, problem, fix)


def plan_table(plans: list[tuple[str, MemoryPlan]]) -> list[str]:
    """A Markdown table of ``(label, plan)`` rows: per rank (the busiest) in GiB, the persistent state and what a step
    or an evaluation holds for a while (docs/sharding.md shows it for full-size pi0)."""
    gib = 2**30
    lines = ["| layout | parameters | gradients | optimizer state | persistent | gathered at peak | activations "
             "(estimate) | evaluation copy | accumulation window |", "|" + "---|" * 9]
    for label, plan in plans:
        held, extra = plan.busiest, plan.transient
        assert extra is not None
        estimate = None if extra.activations is None else extra.activations.total
        activations = "n/a" if estimate is None else f"{estimate / gib:.2f}"
        lines.append(f"| {label} | {held.parameters / gib:.2f} | {held.gradients / gib:.2f} | "
                     f"{held.optimizer_state / gib:.2f} | {held.total / gib:.2f} | {extra.gathered / gib:.2f} | "
                     f"{activations} | {extra.evaluation / gib:.2f} | {extra.accumulation / gib:.2f} |")
    return lines
