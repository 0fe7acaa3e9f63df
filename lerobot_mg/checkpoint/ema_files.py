"""A checkpoint's EMA weights (``ema.enable=true``): ``pretrained_model_ema/`` beside ``pretrained_model/``, as
LeRobot lays them out, in the format of the weights.

The directory is a complete pretrained model: config.json, train_config.json and the processors as in
``pretrained_model/``, and the weights with each trainable parameter replaced by its average (frozen parameters
and buffers as the model holds them). Not sharded: ``model.safetensors`` (or the adapter's files). Sharded: DCP shards
(``pytorch_model_fsdp_0/``, each rank writing its own shard of the averages) when ``checkpoint.format`` writes DCP,
a ``model.safetensors`` gathered onto rank 0 when it writes safetensors; ``lerobot-mg-convert-dcp`` merges the
shards like the weights'. The update count and last decay are ``training_state/ema_state.json``. A resume restores
the averages bit for bit, on any topology (DCP shards reshard; a gathered file is split into this rank's shards).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.dcp_io import load_dcp
from lerobot_mg.checkpoint.formats import AdapterFiles, CheckpointFiles, LargeWrite
from lerobot_mg.checkpoint.state import read_json, write_json
from lerobot_mg.ema import ModelEMA
from lerobot_mg.errors import ConfigError
from lerobot_mg.processors.mixture import save_source_processors

logger = logging.getLogger(__name__)


def ema_model_state(model: nn.Module, ema: ModelEMA, full: bool, main: bool,
                    adapter: AdapterFiles | None = None) -> dict[str, Any]:
    """``model``'s state dict with every trainable parameter replaced by its average: what ``pretrained_model_ema/``
    holds. ``full`` gathers it onto the main process (``main``), on the CPU: collective under FSDP, every rank calls
    it, the others get ``{}``. Otherwise the values are the live tensors (this rank's shards under FSDP).
    ``adapter`` (a PEFT run): the trainable entries only, under adapter keys."""
    options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=adapter is not None)
    state = get_model_state_dict(model, options=options)  # collective when full
    receives = main or not full  # a gather leaves every rank but the main one empty
    ema.swap_into(state, gather=full, receives=receives)  # collective when full
    return adapter.to_adapter(state) if adapter is not None and receives else state


class EMAFiles:
    """Writes and reads ``pretrained_model_ema/`` with the files (format, topology, PEFT adapter) of ``files``."""

    def __init__(self, files: CheckpointFiles, ema: ModelEMA):
        self.files = files
        self.ema = ema

    def _state(self, model: nn.Module, full: bool) -> dict[str, Any]:
        return ema_model_state(model, self.ema, full, self.files.dims.is_main_process, self.files.adapter)

    def large_writes(self, model: nn.Module, policy: nn.Module, ema_dir: Path) -> list[LargeWrite]:
        """This rank's large writes of the averages, as :meth:`CheckpointFiles.large_writes` does the weights'.
        Collective under FSDP."""
        files, main = self.files, self.files.dims.is_main_process
        write_weights = partial(files._write_weights, policy, ema_dir)
        if not files.dims.is_sharded:
            return [LargeWrite(self._state(model, full=False), write_weights)] if main else []
        large = []
        if files.format.writes_dcp:
            large.append(LargeWrite(self._state(model, full=False), partial(files._dcp_save, ema_dir / L.MODEL_DCP_DIR)))
        if files.format.writes_safetensors:
            full = self._state(model, full=True)  # new CPU tensors on rank 0: no staged copy needed
            if main:
                large.append(LargeWrite(full, write_weights, copy=False))
        elif main:
            if files.adapter is not None:
                files.adapter.write_configs(ema_dir)
            else:
                policy.write_config(ema_dir)
        return large

    def write_small(self, step_dir: Path, train_config: dict[str, Any], preprocessor: Any, postprocessor: Any,
                    source_processors: dict[str, tuple[Any, Any]] | None = None) -> None:
        """Main process: the files of ``pretrained_model_ema/`` besides the weights (each source's processors too,
        for a mixture normalised per source), and ``ema_state.json``."""
        ema_dir = step_dir / L.PRETRAINED_MODEL_EMA_DIR
        write_json(ema_dir / L.TRAIN_CONFIG_JSON, train_config)
        for processor in (preprocessor, postprocessor):
            if processor is not None:
                processor.save_pretrained(ema_dir)
        for source, pipelines in (source_processors or {}).items():
            save_source_processors(ema_dir, source, pipelines)
        write_json(step_dir / L.TRAINING_STATE_DIR / L.EMA_STATE, self.ema.state())

    def load(self, step_dir: Path) -> None:
        """Restore the averages and counters from ``step_dir`` (collective under FSDP when the averages are DCP
        shards). A checkpoint saved without EMA starts the average from the loaded weights."""
        ema_dir, state_file = step_dir / L.PRETRAINED_MODEL_EMA_DIR, step_dir / L.TRAINING_STATE_DIR / L.EMA_STATE
        if not state_file.is_file():
            if self.files.dims.is_main_process:
                logger.warning("%s holds no EMA (it was saved with ema.enable=false): the average starts from the "
                               "loaded weights.", step_dir)
            self.ema.restart()
            return
        adapter, shadow = self.files.adapter, self.ema.shadow
        if (ema_dir / L.MODEL_DCP_DIR).is_dir():
            load_dcp(adapter.to_adapter(shadow) if adapter is not None else dict(shadow), ema_dir / L.MODEL_DCP_DIR)
        else:
            weights = ema_dir / (L.ADAPTER_SAFETENSORS if adapter is not None else L.MODEL_SAFETENSORS)
            if not weights.is_file():
                raise ConfigError(f"{weights} is missing: {state_file.name} says the checkpoint has EMA weights. Fix: "
                                  "resume from an earlier complete checkpoint, or with ema.enable=false")
            saved = load_file(str(weights))
            if adapter is not None:
                saved = adapter.to_model(saved, weights)
            missing = sorted(set(shadow) - set(saved))
            if missing:
                raise ConfigError(f"{weights} lacks the averages of {missing[:5]}. Fix: resume with the policy and "
                                  "peft.* settings the checkpoint was saved with")
            for name, average in shadow.items():
                _fill(average, saved[name])
        self.ema.load_state(read_json(state_file))


@torch.no_grad()
def _fill(average: Tensor, full: Tensor) -> None:
    """Copy the full tensor ``full`` into ``average``: its own shard of it when ``average`` is a DTensor (every rank
    read the whole file, so each cuts its shard locally, without communication)."""
    if isinstance(average, DTensor):
        shard = distribute_tensor(full.to(average.dtype), average.device_mesh, average.placements, src_data_rank=None)
        average.to_local().copy_(shard.to_local())
    else:
        average.copy_(full)
