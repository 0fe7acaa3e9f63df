"""The files that hold a checkpoint's weights and optimizer state, chosen by ``checkpoint.format`` and the topology.

Not sharded (1 process, DDP): ``model.safetensors`` (or the adapter's files) and ``optimizer_state.safetensors`` +
``optimizer_param_groups.json``, written by the main process, whatever the format. Sharded (FSDP2, HSDP): the
optimizer is always DCP shards (``optimizer_0/``); the weights are DCP shards (``pytorch_model_fsdp_0/``) when the
format writes DCP, and a gathered ``model.safetensors`` when it writes safetensors (both for ``safetensors_dcp``).
States go through ``torch.distributed.checkpoint.state_dict`` keyed by parameter FQN, so DCP shards reshard to any
topology on load, and a gathered file loads into a sharded run and back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
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
from lerobot_mg.checkpoint.dcp_io import load_dcp, save_dcp
from lerobot_mg.checkpoint.state import (
    flatten_optimizer_state,
    read_json,
    unflatten_optimizer_state,
    write_json,
)
from lerobot_mg.config.choices import CheckpointFormat
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.errors import ConfigError


class AdapterFiles(Protocol):
    """A PEFT run's weights (``lerobot_mg.peft.lora.AdapterWeights``): the trainable parameters only, under the keys
    of adapter_model.safetensors; the frozen base is never written."""

    def to_adapter(self, state_dict: dict[str, Any]) -> dict[str, Any]: ...

    def to_model(self, adapter_state: dict[str, Any], source: Path) -> dict[str, Any]: ...

    def write_configs(self, directory: Path) -> None: ...

    def write(self, directory: Path, adapter_state: dict[str, torch.Tensor]) -> None: ...


@dataclass
class LargeWrite:
    """One of a save's large writes: the tensors and what writes them (given the staged copy when asynchronous)."""

    state: Any
    write: Callable[[Any], None]
    copy: bool = True  # False: tensors made for this save alone (a gathered full state), which need no copy


def tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) state dict: this rank's local shard for a DTensor."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(value) for value in state)
    return 0


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer under accelerate's wrapper. Loading into a fresh optimizer makes
    torch.distributed.checkpoint take one zero-lr step to create the state; through the wrapper under fp16
    that step goes to the GradScaler, which refuses a step without a scaled loss."""
    return getattr(optimizer, "optimizer", optimizer)


def _save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))


class CheckpointFiles:
    """Writes and reads one run's model and optimizer files. ``process_group``: the group DCP shards are written
    through (an asynchronous save's own gloo group; None: the default group)."""

    def __init__(self, checkpoint_format: CheckpointFormat, dims: ParallelDims, adapter: AdapterFiles | None,
                 process_group: dist.ProcessGroup | None = None):
        self.format = checkpoint_format
        self.dims = dims
        self.adapter = adapter
        self._group = process_group

    def large_writes(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: nn.Module, pretrained: Path,
                     training_state: Path) -> list[LargeWrite]:
        """This rank's large writes of a save, not yet run; the small files that go with them (config.json when
        only shards hold the weights, the optimizer's param groups) are written now. Collective under FSDP."""
        main = self.dims.is_main_process
        optimizer = _torch_optimizer(optimizer)
        large: list[LargeWrite] = []
        if not self.dims.is_sharded:
            # On every rank: an optimizer that has not stepped yet (say every fp16 update so far overflowed) gets
            # its state created here by a zero-lr step, and DDP replicas must keep identical optimizer states.
            optimizer_state = get_optimizer_state_dict(model, optimizer)
            if main:
                tensors, groups = flatten_optimizer_state(optimizer_state)
                write_json(training_state / L.OPTIMIZER_PARAM_GROUPS, groups)
                large += [LargeWrite(self._model_state(model), partial(self._write_weights, policy, pretrained)),
                          LargeWrite(tensors, partial(_save_safetensors, training_state / L.OPTIMIZER_STATE))]
            return large
        if self.format.writes_dcp:
            large.append(LargeWrite(self._model_state(model), partial(self._dcp_save, pretrained / L.MODEL_DCP_DIR)))
        if self.format.writes_safetensors:
            # The gather is collective; the full (fp32 master) weights land on rank 0 only, as new CPU tensors
            # that training never touches: they need no staged copy.
            full = self._model_state(model, full=True)
            if main:
                large.append(LargeWrite(full, partial(self._write_weights, policy, pretrained), copy=False))
        elif main:
            if self.adapter is not None:  # the converter names the merged file after adapter_config.json
                self.adapter.write_configs(pretrained)
            else:
                policy.write_config(pretrained)
        large.append(LargeWrite(get_optimizer_state_dict(model, optimizer),
                                partial(self._dcp_save, training_state / L.OPTIMIZER_DCP_DIR)))
        return large

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, pretrained: Path,
             training_state: Path) -> None:
        """Restore model and optimizer from whichever files the checkpoint holds (DCP shards reshard to this
        topology; a single file is distributed). Collective under FSDP."""
        optimizer = _torch_optimizer(optimizer)
        self._load_model(model, pretrained)
        if (training_state / L.OPTIMIZER_DCP_DIR).is_dir():
            osd = get_optimizer_state_dict(model, optimizer)
            load_dcp(osd, training_state / L.OPTIMIZER_DCP_DIR)
            set_optimizer_state_dict(model, optimizer, osd)
        else:
            osd = unflatten_optimizer_state(
                load_file(str(training_state / L.OPTIMIZER_STATE)), read_json(training_state / L.OPTIMIZER_PARAM_GROUPS)
            )
            set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=self.dims.is_sharded))

    def _model_state(self, model: nn.Module, full: bool = False) -> dict[str, Any]:
        """The weights a checkpoint holds (adapter keys for PEFT). ``full`` gathers them onto rank 0, on the CPU:
        collective under FSDP."""
        options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=self.adapter is not None)
        state = get_model_state_dict(model, options=options)
        if self.adapter is None or (full and not self.dims.is_main_process):  # a gather leaves other ranks empty
            return state
        return self.adapter.to_adapter(state)

    def _write_weights(self, policy: nn.Module, pretrained: Path, state: dict[str, Any]) -> None:
        """model.safetensors + config.json, or the adapter's files."""
        if self.adapter is not None:
            self.adapter.write(pretrained, state)
        else:
            policy.save_pretrained(pretrained, state_dict=state)

    def _dcp_save(self, directory: Path, state: dict[str, Any]) -> None:
        """Collective over this rank's DCP group (the side group when asynchronous)."""
        save_dcp(state, directory, process_group=self._group)

    def _load_model(self, model: nn.Module, pretrained: Path) -> None:
        strict = self.adapter is None
        if (pretrained / L.MODEL_DCP_DIR).is_dir():
            state = self._model_state(model)
            load_dcp(state, pretrained / L.MODEL_DCP_DIR)
            if self.adapter is not None:
                state = self.adapter.to_model(state, pretrained / L.MODEL_DCP_DIR)
            set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
            return
        weights = pretrained / (L.ADAPTER_SAFETENSORS if self.adapter is not None else L.MODEL_SAFETENSORS)
        if not weights.is_file():
            raise ConfigError(f"{weights} is missing: the checkpoint was not saved by a run with this run's peft.* "
                              "settings. Fix: resume with the settings it was saved with")
        state = load_file(str(weights))
        if self.adapter is not None:
            state = self.adapter.to_model(state, weights)
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=self.dims.is_sharded, strict=strict))
