"""The accelerator factory: the only module that configures accelerate.

It builds one ``Accelerator`` for all three layouts (DDP, FSDP2, HSDP) with every plugin field set
explicitly, and it prepares the model: wrap units are chosen and checked by :mod:`.wrap`, sharded with the
same arguments accelerate gives the root, then ``accelerator.prepare`` wraps the root.

The run's process group maps each device type to its backend (:func:`process_group_backend`): on a GPU run
``cuda:nccl,cpu:gloo``, so a collective on a CPU tensor (a host-side flag, a CPU-offloaded DTensor's norm) runs on
gloo and one on a GPU tensor on NCCL, over the default group and over every device-mesh group, which inherit the
default group's backends. docs/launching.md states the rule; tests/unit/test_collectives.py holds every call site
to it.

Rehearsing a layout on a CPU-only host is a feature (tests run FSDP2/HSDP on gloo). Accelerate only picks FSDP
for GPU-like devices and builds no fp16 autocast or loss scaler on the CPU; :func:`_rehearse_on_cpu` and
:func:`_enable_cpu_fp16` are the two places that work around that, and ``tests/unit/test_accelerate_canary.py``
pins the accelerate internals they rely on. On one launched process accelerate builds neither the device mesh of
a sharded layout nor the DDP wrapper of a GPU run; :func:`_one_rank_mesh` and :func:`prepare` supply them.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from accelerate.state import PartialState
from accelerate.utils import DistributedType, GradientAccumulationPlugin
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from lerobot_mg.config.schema import AcceleratorConfig, FSDPConfig
from lerobot_mg.distributed.device import use_cpu
from lerobot_mg.distributed.parallel_dims import Layout, ParallelDims
from lerobot_mg.distributed.wrap import (
    UnitPlan,
    checkpoint_activations,
    compile_forward,
    find_split_ties,
    freeze_unused,
    plan_units,
)
from lerobot_mg.errors import ConfigError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# The process group's backend per device type. GPU runs: NCCL for CUDA tensors and gloo for CPU tensors (a plain
# "nccl" group refuses every CPU tensor). CPU runs: gloo (accelerate would pick MPI where torch has it).
GPU_BACKEND = "cuda:nccl,cpu:gloo"
CPU_BACKEND = "gloo"


def process_group_backend(cpu: bool) -> str:
    """The backend string of the run's default process group: :data:`CPU_BACKEND` for a CPU run, else
    :data:`GPU_BACKEND`. Device-mesh groups (FSDP2, HSDP) inherit it."""
    return CPU_BACKEND if cpu else GPU_BACKEND


# Process groups this process has created. A local sweep under torchrun trains its points one after another in the
# same processes, so every rank counts the same groups in the same order.
_process_group_count = itertools.count()


def _create_process_group(cpu: bool, timeout: timedelta, distributed: bool) -> None:
    """Create the run's process group through accelerate's ``PartialState``, with our backend map and timeout and,
    from the second group of this process on, a rendezvous-store namespace of its own (no group at all for a
    process started without a launcher).

    accelerate's ``InitProcessGroupKwargs`` passes on only values that differ from its defaults (600 s would
    silently become gloo's 30 minutes), so the timeout goes to ``PartialState`` directly. torchrun's rendezvous
    store outlives each process group: a new group whose rank reads the previous group's keys connects to a peer
    that is gone and hangs. A fresh namespace per group avoids that.
    """
    if not distributed:
        PartialState(cpu=cpu)
        return
    index = next(_process_group_count)
    if index == 0:
        PartialState(cpu=cpu, timeout=timeout, backend=process_group_backend(cpu))
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    PartialState(cpu=cpu, timeout=timeout, backend=process_group_backend(cpu),
                 store=dist.PrefixStore(f"lerobot_mg_group{index}", store), rank=rank, world_size=world_size)


def _rehearse_on_cpu() -> None:
    """Let accelerate build FSDP2/HSDP on a CPU-only host (gloo).

    ``AcceleratorState`` only chooses FSDP when the shared ``PartialState`` reports a GPU-like distributed type;
    with ``cpu=True`` it reports MULTI_CPU and accelerate silently falls back to DDP. Creating the
    ``PartialState`` first and relabelling it makes the same Accelerator build FSDP2 on gloo.
    """
    state = PartialState(cpu=True)
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def _enable_cpu_fp16(accelerator: Accelerator) -> None:
    """fp16 on the CPU: accelerate turns neither autocast nor a loss scaler on for a CPU device."""
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "fp16" and accelerator.scaler is None:
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu")


def _offload_policy(fsdp: FSDPConfig, cpu: bool):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not fsdp.cpu_offload:
        return OffloadPolicy()
    # Pinned host memory needs a GPU; without one the same policy unpinned works.
    return CPUOffloadPolicy(pin_memory=not cpu)


def _mixed_precision_policy(acc_cfg: AcceleratorConfig):
    """The user's MixedPrecisionPolicy when any field is set (built from those fields alone), else None and
    accelerate derives one from ``accelerator.mixed_precision``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fields = acc_cfg.fsdp.mixed_precision_policy
    if not fields.is_set():
        return None
    kwargs = {
        name: _DTYPES[getattr(fields, name)]
        for name in ("param_dtype", "reduce_dtype", "output_dtype")
        if getattr(fields, name) is not None
    }
    if fields.cast_forward_inputs is not None:
        kwargs["cast_forward_inputs"] = fields.cast_forward_inputs
    return MixedPrecisionPolicy(**kwargs)


def build_accelerator(acc_cfg: AcceleratorConfig, dims: ParallelDims) -> Accelerator:
    """One Accelerator for the layout of ``dims``. Collective: every rank must call it."""
    cpu = use_cpu(acc_cfg)
    _create_process_group(cpu, timedelta(seconds=acc_cfg.process_group_timeout_s), dims.is_distributed)
    fsdp_plugin = None
    parallelism_config = None
    if dims.is_sharded:
        if cpu:
            _rehearse_on_cpu()
        fsdp = acc_cfg.fsdp
        fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            reshard_after_forward=fsdp.reshard_after_forward,
            # Units are chosen by lerobot_mg.distributed.wrap and sharded before prepare; accelerate wraps the root.
            auto_wrap_policy="no_wrap",
            transformer_cls_names_to_wrap=None,
            min_num_params=0,
            cpu_offload=_offload_policy(fsdp, cpu),
            ignored_modules=fsdp.ignored_modules,
            mixed_precision_policy=_mixed_precision_policy(acc_cfg),
            state_dict_type="SHARDED_STATE_DICT",
            cpu_ram_efficient_loading=False,
            activation_checkpointing=False,
            activation_checkpointing_offload=False,
            # FSDP1-only knobs: None is the only value FSDP2 accepts (it always keeps the original parameters
            # and needs no module-state sync).
            forward_prefetch=None,
            use_orig_params=None,
            sync_module_states=None,
        )
        parallelism_config = ParallelismConfig(dp_replicate_size=dims.dp_replicate, dp_shard_size=dims.dp_shard)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=acc_cfg.mixed_precision,
        gradient_accumulation_plugin=accumulation_plugin(acc_cfg.gradient_accumulation.steps, dims),
        fsdp_plugin=fsdp_plugin,
        parallelism_config=parallelism_config,
        step_scheduler_with_optimizer=False,
        device_placement=True,
        log_with=None,
    )
    if dims.is_sharded and accelerator.distributed_type != DistributedType.FSDP:
        raise RuntimeError(
            f"accelerate built {accelerator.distributed_type} instead of FSDP for {dims.describe()}; "
            "the accelerate version is not one this factory supports (see test_accelerate_canary.py)"
        )
    if accelerator.num_processes != dims.world_size:
        raise RuntimeError(
            f"accelerate sees {accelerator.num_processes} processes but the launcher's WORLD_SIZE is "
            f"{dims.world_size}"
        )
    _enable_cpu_fp16(accelerator)
    if dims.is_sharded and accelerator.torch_device_mesh is None:
        accelerator.state.device_mesh = _one_rank_mesh(accelerator.device.type)
    if dims.is_distributed:
        _set_mesh_timeouts(accelerator, timedelta(seconds=acc_cfg.process_group_timeout_s))
    return accelerator


def accumulation_plugin(steps: int, dims: ParallelDims) -> GradientAccumulationPlugin:
    """Gradient accumulation over ``steps`` micro-batches, keeping a sharded run's gradients sharded.

    DDP (and one process) accumulates locally under accelerate's ``no_sync`` and all-reduces once per window. Under
    FSDP2/HSDP ``no_sync`` would keep every parameter's full, unsharded gradient on every rank for the whole window;
    ``sync_each_batch`` keeps accelerate from entering it, so every micro-batch's backward reduce-scatters and each
    rank accumulates only its shard (HSDP skips the replica all-reduce until the window's last micro-batch:
    ``lerobot_mg.step.Stepper``). The update is the same; the window costs one reduce-scatter per micro-batch.
    """
    return GradientAccumulationPlugin(num_steps=steps, sync_each_batch=dims.is_sharded)


def _one_rank_mesh(device_type: str) -> DeviceMesh:
    """The device mesh of FSDP2 on one process, which accelerate does not build.

    For ``dp_shard_size=1`` accelerate's ``ParallelismConfig`` has no enabled dimension, so it builds no mesh, and
    ``fully_shard`` would then pick a world mesh of the machine's accelerator type (CUDA on a GPU host even for a CPU
    run). The mesh built here has the one dimension accelerate's 1-dimensional FSDP mesh is read by
    (``parallelism_config.fsdp_dim_names``: ``dp_shard_cp``), spans the default group and so inherits its backends.
    """
    return init_device_mesh(device_type, (1,), mesh_dim_names=("dp_shard_cp",))


def prepare(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
            dims: ParallelDims) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``accelerator.prepare`` of the model (wrapping the root: FSDP2 or DDP) and its optimizer. Collective.

    accelerate wraps DDP for one launched process on the CPU but not on a GPU (it wraps GPU models only for more
    than one process): a DDP layout is wrapped here then, so one GPU runs DDP's reducer on the 1-rank group too.
    """
    model, optimizer = accelerator.prepare(model, optimizer)
    if dims.is_sharded:
        _register_inference_methods(model)
    if dims.layout is Layout.DDP and not isinstance(model, DistributedDataParallel):
        device_ids = None if accelerator.device.type == "cpu" else [accelerator.device]
        model = DistributedDataParallel(model, device_ids=device_ids)
    return model, optimizer


# Policy methods that run the network without calling the root's forward (evaluation's rollouts).
INFERENCE_METHODS = ("predict_action_chunk",)


def _register_inference_methods(model: nn.Module) -> None:
    """Let the sharded root gather its own parameters (those outside every unit) around :data:`INFERENCE_METHODS`
    as it does around ``forward``: an evaluation through the sharded model calls ``predict_action_chunk``."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    for method in INFERENCE_METHODS:
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)


def _set_mesh_timeouts(accelerator: Accelerator, timeout: timedelta) -> None:
    """Give the device mesh's process groups (HSDP's replicate and shard groups) the run's timeout.

    The mesh creates them with ``new_group(timeout=None)``, which means torch's default (30 minutes on gloo, 10 on
    NCCL), not the default group's: a rank hung in a shard-group collective would hold its peers for 30 minutes.
    torch has no public setter; ``_set_pg_timeout`` is what torchtitan uses for the same purpose.
    tests/dist/test_layouts.py checks every group's timeout on a real HSDP mesh. Not a collective: each rank sets
    its own groups.
    """
    mesh = accelerator.torch_device_mesh
    if mesh is None:
        return
    for group in {*mesh.get_all_groups(), dist.group.WORLD}:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def prepare_units(
    accelerator: Accelerator, model: nn.Module, acc_cfg: AcceleratorConfig, dims: ParallelDims
) -> None:
    """Freeze the parameters the policy declares unused (``unused_parameter_names``), then apply, in this order,
    activation checkpointing, torch.compile and FSDP sharding to the units :func:`plan_units` chooses, before
    ``accelerator.prepare`` wraps the root (FSDP2 or DDP). Collective: every rank must call it.
    """
    frozen = freeze_unused(model)
    plan = plan_units(model, acc_cfg, dims.is_sharded)
    for _, block in plan.checkpointed:
        checkpoint_activations(block)
    for _, target in plan.compiled:
        compile_forward(target)
    if dims.is_sharded:
        _shard(accelerator, model, plan)
    if accelerator.is_main_process:
        if frozen:
            logger.info("Frozen (no gradient reaches them; kept in checkpoints): %d parameters, e.g. %s", len(frozen),
                        frozen[0])
        for line in plan.describe():
            logger.info(line)


def _shard(accelerator: Accelerator, model: nn.Module, plan: UnitPlan) -> None:
    """Check the wrap units for split ties and shard them with the arguments accelerate gives the root: the
    policy's unit groups (one ``fully_shard`` over each group's modules), then the single-module units, bottom-up
    (a unit nested in a group member goes before its group), then the modules of unused parameters alone."""
    from accelerate.utils.fsdp_utils import get_parameters_from_modules
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ties = find_split_ties(model, plan.units + plan.idle, plan.groups)
    if ties:
        raise ConfigError(
            "FSDP cannot split tied weights across wrap units, and these parameters would be split: "
            + "; ".join(ties)
            + f" (units chosen by {plan.rule}). Fix: wrap the repeated block class (accelerator.fsdp.wrap_modules) so "
            "both users of the tied weight stay together, e.g. in the root unit."
        )
    if accelerator.mixed_precision != "no":
        _upcast_trainable(model, accelerator.is_main_process)
    plugin = accelerator.state.fsdp_plugin
    mesh = accelerator.torch_device_mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
    }
    if plugin.ignored_modules is not None:
        kwargs["ignored_params"] = get_parameters_from_modules(plugin.ignored_modules, model, accelerator.device)
    member_names = [name for group in plan.groups for name in group.names]
    inside = [(n, u) for n, u in plan.units if any(n.startswith(f"{member}.") for member in member_names)]
    for _, unit in inside:
        fully_shard(unit, **kwargs)
    for group in plan.groups:
        fully_shard(list(group.modules), **kwargs)
    for name, unit in plan.units:
        if (name, unit) not in inside:
            fully_shard(unit, **kwargs)
    for _, unit in plan.idle:
        fully_shard(unit, **kwargs)


def _upcast_trainable(model: nn.Module, log: bool) -> None:
    """fp32 master copies of every trainable parameter, before any unit is sharded.

    FSDP2 needs one original dtype among the trainable parameters of a unit (a bf16 base fine-tuned with PEFT has
    fp32 adapters beside bf16 copies of its full-training modules); the MixedPrecisionPolicy casts for compute.
    Accelerate's prepare does the same upcast, but only when it shards the root, after our units.
    """
    upcast = [name for name, param in model.named_parameters() if param.requires_grad and param.dtype != torch.float32]
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
    if log and upcast:
        logger.info("Upcast %d trainable parameters to fp32 master weights (mixed precision), e.g. %s", len(upcast),
                    upcast[0])


def ignored_trainable_params(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters FSDP left as plain tensors (``accelerator.fsdp.ignored_modules``).

    FSDP does not reduce their gradients; :func:`sync_ignored_grads` must, or the replicas drift apart.
    """
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]


def sync_ignored_grads(params: list[nn.Parameter], world_size: int) -> None:
    """Average the gradients of ``params`` over all ranks. Collective: every rank must call it, on sync steps."""
    if not params or world_size == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    flat /= world_size
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


def sync_found_inf(accelerator: Accelerator, optimizer: torch.optim.Optimizer) -> None:
    """After the loss scaler unscaled the gradients: an inf/nan on any rank makes every rank skip the step.

    Gradients that were reduced across ranks carry an overflow to every rank, and on torch 2.13 the DTensor
    dispatcher already takes the max of ``found_inf`` over the shards of FSDP2 gradients. This explicit
    all-reduce is the guard that does not depend on either: an inf that appears after the reduction (or
    in a parameter FSDP ignores) still makes all ranks skip together. Collective: every rank must call it,
    on sync steps.
    """
    scaler = accelerator.scaler
    if scaler is None or accelerator.num_processes == 1:
        return
    inner = optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    state = scaler._per_optimizer_states[id(inner)]
    for found_inf in state["found_inf_per_device"].values():
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)


def launch_world() -> tuple[int, int, int]:
    """(world_size, rank, local_rank) from the launcher's environment, before any process group exists."""
    return (
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def launched(environ: Mapping[str, str] | None = None) -> bool:
    """A launcher (torchrun, accelerate launch, SLURM through submitit) started this process: it exports
    ``WORLD_SIZE``, which a plain ``python`` start lacks. ``environ``: default this process's environment."""
    return "WORLD_SIZE" in (os.environ if environ is None else environ)
