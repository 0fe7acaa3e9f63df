"""Saving and resuming checkpoints for single-process, DDP, FSDP2 and HSDP runs.

Saves are collective: every rank enters :meth:`CheckpointManager.save`. DCP shards are written by every rank;
gathered weights, json sidecars and the RNG file by the main process alone. Model and optimizer states go
through ``torch.distributed.checkpoint.state_dict`` keyed by parameter FQN, so a DCP checkpoint reshards to
any topology on load, and a non-sharded checkpoint loads into a sharded run and back.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.state import (
    capture_rng_state,
    flatten_optimizer_state,
    pack_rank_states,
    read_json,
    restore_rng_state,
    scheduler_state_from_json,
    scheduler_state_to_json,
    unflatten_optimizer_state,
    unpack_rank_states,
    write_json,
)
from lerobot_mg.distributed.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from lerobot_mg.peft.lora import AdapterWeights

logger = logging.getLogger(__name__)


@dataclass
class SaveItems:
    """Everything a checkpoint holds besides model and optimizer."""

    policy: nn.Module  # the unwrapped policy: writes config.json and gathered weights
    preprocessor: Any
    postprocessor: Any
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: torch.amp.GradScaler | None
    train_config: dict[str, Any]
    training_step: dict[str, Any]  # step, batch arithmetic, topology, sampler position, revisions...


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer under accelerate's wrapper. Loading into a fresh optimizer makes
    torch.distributed.checkpoint take one zero-lr step to create the state; through the wrapper under fp16
    that step goes to the GradScaler, which refuses a step without a scaled loss."""
    return getattr(optimizer, "optimizer", optimizer)


def _barrier(dims: ParallelDims) -> None:
    if dims.is_distributed:
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """``adapter`` (PEFT runs): weights are the trainable parameters only, as adapter_model.safetensors +
    adapter_config.json or as DCP shards under the same keys; the frozen base is never written."""

    def __init__(self, output_dir: Path, checkpoint_format: str, keep_last: int | None, dims: ParallelDims,
                 adapter: AdapterWeights | None = None):
        self.root = L.checkpoints_root(output_dir)
        self.format = checkpoint_format
        self.keep_last = keep_last
        self.dims = dims
        self.adapter = adapter

    def _model_state(self, model: nn.Module, full: bool = False) -> dict[str, Any]:
        """The weights a checkpoint holds (adapter keys for PEFT). ``full`` gathers them onto rank 0, on the CPU:
        collective under FSDP."""
        options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=self.adapter is not None)
        state = get_model_state_dict(model, options=options)
        if self.adapter is None or (full and not self.dims.is_main_process):  # a gather leaves other ranks empty
            return state
        return self.adapter.to_adapter(state)

    def _write_weights(self, policy: nn.Module, pretrained: Path, state: dict[str, Any]) -> None:
        if self.adapter is not None:
            self.adapter.write(pretrained, state)
        else:
            policy.save_pretrained(pretrained, state_dict=state)

    def _load_model(self, model: nn.Module, pretrained: Path) -> None:
        """Collective under FSDP: DCP shards reshard to this topology; a single file is distributed."""
        strict = self.adapter is None
        if (pretrained / L.MODEL_DCP_DIR).is_dir():
            state = self._model_state(model)
            dcp.load(state, checkpoint_id=pretrained / L.MODEL_DCP_DIR)
            if self.adapter is not None:
                state = self.adapter.to_model(state, pretrained / L.MODEL_DCP_DIR)
            set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
            return
        weights = pretrained / (L.ADAPTER_SAFETENSORS if self.adapter is not None else L.MODEL_SAFETENSORS)
        if not weights.is_file():
            raise ValueError(f"{weights} is missing: the checkpoint was not saved by a run with this run's peft.* "
                             "settings. Fix: resume with the settings it was saved with")
        state = load_file(str(weights))
        if self.adapter is not None:
            state = self.adapter.to_model(state, weights)
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=self.dims.is_sharded, strict=strict))

    # ------------------------------------------------------------------------------------------- save ----
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, items: SaveItems) -> Path:
        """Write checkpoint ``step`` and move ``last`` to it once complete. Collective: every rank calls it."""
        dims, main = self.dims, self.dims.is_main_process
        optimizer = _torch_optimizer(optimizer)
        name = L.step_dir_name(step)
        tmp = self.root / f"{L.TMP_PREFIX}{name}"
        if main:
            for stale in self.root.glob(f"{L.TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / L.PRETRAINED_MODEL_DIR).mkdir(parents=True)
            (tmp / L.TRAINING_STATE_DIR).mkdir(parents=True)
        _barrier(dims)
        pretrained, training_state = tmp / L.PRETRAINED_MODEL_DIR, tmp / L.TRAINING_STATE_DIR

        if dims.is_sharded:
            if self.format in ("dcp", "safetensors_dcp"):
                dcp.save(self._model_state(model), checkpoint_id=pretrained / L.MODEL_DCP_DIR)
            if self.format in ("safetensors", "safetensors_dcp"):
                # The gather is collective; the full (fp32 master) weights land on rank 0 only.
                full = self._model_state(model, full=True)
                if main:
                    self._write_weights(items.policy, pretrained, full)
                del full
            elif main:
                if self.adapter is not None:  # the converter names the merged file after adapter_config.json
                    self.adapter.write_configs(pretrained)
                else:
                    items.policy.write_config(pretrained)
            dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=training_state / L.OPTIMIZER_DCP_DIR)
        else:
            # On every rank: an optimizer that has not stepped yet (say every fp16 update so far overflowed) gets
            # its state created here by a zero-lr step, and DDP replicas must keep identical optimizer states.
            optimizer_state = get_optimizer_state_dict(model, optimizer)
            if main:
                self._write_weights(items.policy, pretrained, self._model_state(model))
                tensors, groups = flatten_optimizer_state(optimizer_state)
                save_file(tensors, str(training_state / L.OPTIMIZER_STATE))
                write_json(training_state / L.OPTIMIZER_PARAM_GROUPS, groups)

        rng_states = self._gather_rng_states()
        if main:
            save_file(pack_rank_states(rng_states), str(training_state / L.RNG_STATE))
            write_json(pretrained / L.TRAIN_CONFIG_JSON, items.train_config)
            if items.preprocessor is not None:
                items.preprocessor.save_pretrained(pretrained)
            if items.postprocessor is not None:
                items.postprocessor.save_pretrained(pretrained)
            if items.scheduler is not None:
                write_json(training_state / L.SCHEDULER_STATE, scheduler_state_to_json(items.scheduler.state_dict()))
            if items.scaler is not None:
                write_json(training_state / L.SCALER_STATE, items.scaler.state_dict())
        _barrier(dims)  # every shard is on disk before the marker
        final = self.root / name
        if main:
            write_json(training_state / L.TRAINING_STEP, items.training_step)  # the completion marker, last
            _fsync_dir(training_state)
            replaced = None
            if final.exists():
                # Re-saving a step after resuming from an older checkpoint; `last` may name the old copy. Renames
                # instead of a delete keep the old copy whole until the new one is in place.
                replaced = self.root / f"{L.TMP_PREFIX}replaced-{name}"
                os.replace(final, replaced)
            os.replace(tmp, final)
            link_tmp = self.root / f"{L.TMP_PREFIX}{L.LAST_LINK}"
            if link_tmp.is_symlink() or link_tmp.exists():
                link_tmp.unlink()
            link_tmp.symlink_to(name)
            os.replace(link_tmp, self.root / L.LAST_LINK)
            _fsync_dir(self.root)
            if replaced is not None:
                shutil.rmtree(replaced)
            self._prune(keep=name)
        _barrier(dims)
        return final

    def _gather_rng_states(self) -> list[dict[str, torch.Tensor]]:
        mine = capture_rng_state()
        if not self.dims.is_distributed:
            return [mine]
        gathered: list[Any] = [None] * self.dims.world_size
        dist.all_gather_object(gathered, mine)
        return gathered

    def _prune(self, keep: str) -> None:
        if self.keep_last is None:
            return
        steps = L.complete_step_dirs(self.root.parent)
        for old in steps[: max(0, len(steps) - self.keep_last)]:
            if old.name != keep:
                shutil.rmtree(old)

    # ------------------------------------------------------------------------------------------- load ----
    def load(
        self,
        step_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        scaler: torch.amp.GradScaler | None,
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, scaler and this rank's RNG; returns training_step.json.

        Collective: every rank calls it. Call :func:`check_resumable` first (before any process group).
        """
        pretrained, training_state = step_dir / L.PRETRAINED_MODEL_DIR, step_dir / L.TRAINING_STATE_DIR
        sharded = self.dims.is_sharded
        optimizer = _torch_optimizer(optimizer)
        self._load_model(model, pretrained)

        if (training_state / L.OPTIMIZER_DCP_DIR).is_dir():
            osd = get_optimizer_state_dict(model, optimizer)
            dcp.load(osd, checkpoint_id=training_state / L.OPTIMIZER_DCP_DIR)
            set_optimizer_state_dict(model, optimizer, osd)
        else:
            osd = unflatten_optimizer_state(
                load_file(str(training_state / L.OPTIMIZER_STATE)), read_json(training_state / L.OPTIMIZER_PARAM_GROUPS)
            )
            set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=sharded))

        if scheduler is not None and (training_state / L.SCHEDULER_STATE).is_file():
            scheduler.load_state_dict(scheduler_state_from_json(read_json(training_state / L.SCHEDULER_STATE)))
        if scaler is not None and (training_state / L.SCALER_STATE).is_file():
            scaler.load_state_dict(read_json(training_state / L.SCALER_STATE))

        per_rank = unpack_rank_states(load_file(str(training_state / L.RNG_STATE)))
        info = read_json(training_state / L.TRAINING_STEP)
        if len(per_rank) == self.dims.world_size:
            restore_rng_state(per_rank[self.dims.rank])
        else:
            # Another world size: ranks cannot inherit streams one to one. Reuse rank r mod saved ranks so
            # runs stay reproducible; the sampler decides data order on its own (seed, epoch) anyway.
            restore_rng_state(per_rank[self.dims.rank % len(per_rank)])
        _barrier(self.dims)
        return info


def _dcp_missing_files(dcp_dir: Path) -> list[str]:
    """Files the DCP metadata references that are not on disk."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(dcp_dir)).read_metadata()
    wanted = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted(name for name in wanted if not (dcp_dir / name).is_file())


def check_resumable(step_dir: Path) -> dict[str, Any]:
    """Raise ``ValueError`` (naming the file and the remedy) if this code cannot resume ``step_dir``.

    Runs before any process group exists; returns training_step.json.
    """
    pretrained, training_state = step_dir / L.PRETRAINED_MODEL_DIR, step_dir / L.TRAINING_STATE_DIR
    marker = training_state / L.TRAINING_STEP
    if not marker.is_file():
        raise ValueError(
            f"{marker} is missing: {step_dir} is not a complete checkpoint (a save was interrupted). "
            f"Fix: resume from config_path={step_dir.parent / L.LAST_LINK / L.PRETRAINED_MODEL_DIR / L.TRAIN_CONFIG_JSON}, "
            "which always names the last complete checkpoint"
        )
    info = read_json(marker)
    if "facts" not in info:
        raise ValueError(f"{marker} holds no run facts: the checkpoint was written by an older lerobot_mg. Fix: resume "
                         "it with that version, or start a new run from its weights")
    saved_sharded = info["facts"]["topology"]["dp_shard"] > 1

    model_dcp = pretrained / L.MODEL_DCP_DIR
    if model_dcp.is_dir():
        missing = _dcp_missing_files(model_dcp)
        if missing:
            remedy = (
                f"delete {model_dcp} to resume from {pretrained / L.MODEL_SAFETENSORS}"
                if (pretrained / L.MODEL_SAFETENSORS).is_file()
                else "restore the missing shard files; this checkpoint cannot be resumed without them"
            )
            raise ValueError(f"{model_dcp} is missing shard file(s) {missing}. Fix: {remedy}")
    elif not ((pretrained / L.MODEL_SAFETENSORS).is_file() or (pretrained / L.ADAPTER_SAFETENSORS).is_file()):
        raise ValueError(
            f"{pretrained} holds none of {L.MODEL_SAFETENSORS}, {L.ADAPTER_SAFETENSORS}, {L.MODEL_DCP_DIR}/: no "
            "weights to resume from."
        )

    optim_dcp = training_state / L.OPTIMIZER_DCP_DIR
    if optim_dcp.is_dir():
        missing = _dcp_missing_files(optim_dcp)
        if missing:
            raise ValueError(
                f"{optim_dcp} is missing shard file(s) {missing}. Fix: restore them, or resume from an earlier "
                "complete checkpoint"
            )
    elif (training_state / L.OPTIMIZER_STATE).is_file():
        if saved_sharded:
            raise ValueError(
                f"{training_state / L.OPTIMIZER_STATE} is a gathered full optimizer state of a sharded run (the "
                "LeRobot <= 0.6.x FSDP layout), which cannot be resumed: sharded runs keep their optimizer as "
                f"DCP shards in {L.OPTIMIZER_DCP_DIR}/. Fix: start a new run from the weights (run "
                "lerobot-mg-convert-dcp if they are DCP shards) instead of resuming"
            )
        if not (training_state / L.OPTIMIZER_PARAM_GROUPS).is_file():
            raise ValueError(f"{training_state / L.OPTIMIZER_PARAM_GROUPS} is missing; the optimizer cannot be restored.")
    else:
        raise ValueError(f"{training_state} holds no optimizer state ({L.OPTIMIZER_STATE} or {L.OPTIMIZER_DCP_DIR}/).")
    if not (training_state / L.RNG_STATE).is_file():
        raise ValueError(f"{training_state / L.RNG_STATE} is missing; the RNG state cannot be restored.")
    return info
