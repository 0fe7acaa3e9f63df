"""An exponential moving average (EMA) of the trained weights, with Diffusion Policy's warm-up schedule.

``ema.enable=true`` keeps, beside every trainable parameter, its average over the optimizer updates so far. After
each update (not each accumulation micro-step) every average moves towards its parameter:
``ema = decay * ema + (1 - decay) * param``, where the decay after ``n`` earlier updates is, as Diffusion Policy
computes it (diffusion_policy/model/diffusion/ema_model.py)::

    k = max(0, n - ema.update_after_step - 1)
    decay = 0                                                               if k == 0
    decay = clamp(1 - (1 + k / ema.inv_gamma) ** -ema.power, ema.min_decay, ema.max_decay)  otherwise

so the average starts as a copy of the weights and forgets its start faster than a fixed decay would. The decay is
a Python number computed on the host from the update count: an update never waits for the device.

Under FSDP2 and HSDP the parameters are sharded DTensors and each average is a clone of its parameter, sharded the
same way: every rank averages its own shard, locally, with no communication, and holds 1/dp_shard of the bytes a
DDP rank holds. Frozen parameters and buffers are not averaged: a checkpoint's ``pretrained_model_ema/`` takes them
from the model as it is (lerobot_mg.checkpoint.ema_files), as LeRobot's EMA weights do. :meth:`ModelEMA.swap_into` puts
the averages in a state dict of the model: the one way a checkpoint's EMA weights and an evaluation's
(``ema.use_for_eval``) are made.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lerobot_mg.config.schema import EMAConfig


def ema_decay(cfg: EMAConfig, updates_before: int) -> float:
    """The decay of the update that follows ``updates_before`` earlier ones (Diffusion Policy's ``get_decay``)."""
    k = max(0, updates_before - cfg.update_after_step - 1)
    if k == 0:
        return 0.0
    return max(cfg.min_decay, min(1.0 - (1.0 + k / cfg.inv_gamma) ** -cfg.power, cfg.max_decay))


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the same memory), a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class ModelEMA:
    """The averages of ``model``'s trainable parameters, keyed by parameter FQN (the names
    ``torch.distributed.checkpoint.state_dict`` gives them, under DDP and FSDP2 alike). ``model`` is the unwrapped
    policy (FSDP2 shards it in place; under DDP it is ``model.module``), already sharded when the run shards."""

    def __init__(self, cfg: EMAConfig, model: nn.Module):
        self.cfg = cfg
        self.model = model
        self.updates = 0  # optimizer updates averaged so far
        self.decay = 0.0  # the decay of the last update
        self.shadow: dict[str, Tensor] = {}
        self.restart()

    @classmethod
    def of(cls, cfg: EMAConfig, model: nn.Module) -> ModelEMA | None:
        """None unless ``ema.enable``."""
        return cls(cfg, model) if cfg.enable else None

    def _trainable(self) -> dict[str, Tensor]:
        # Looked up at every update: FSDP2 may replace a parameter object (e.g. when a checkpoint is loaded).
        return {name: param for name, param in self.model.named_parameters() if param.requires_grad}

    @torch.no_grad()
    def restart(self) -> None:
        """Start over from the weights as they are (a new run, or a resume from a checkpoint without EMA)."""
        self.shadow = {name: param.detach().clone() for name, param in self._trainable().items()}
        self.updates, self.decay = 0, 0.0

    @torch.no_grad()
    def update(self) -> None:
        """Average the weights of the optimizer update just made. Every rank calls it after every update; it is
        local to the rank (no collective, no host sync)."""
        self.decay = ema_decay(self.cfg, self.updates)
        params = self._trainable()
        shadow = [_local(self.shadow[name]) for name in params]
        live = [_local(param.detach()) for param in params.values()]
        # Diffusion Policy's arithmetic: ema * decay + param * (1 - decay).
        torch._foreach_mul_(shadow, self.decay)
        torch._foreach_add_(shadow, live, alpha=1.0 - self.decay)
        self.updates += 1

    @torch.no_grad()
    def swap_into(self, state: dict[str, Any], gather: bool = False, receives: bool = True) -> dict[str, Any]:
        """``state``, a state dict of the model (keyed by FQN, as ``get_model_state_dict`` gives it), with the entry
        of every averaged parameter replaced by its average, in place: the weights a checkpoint's
        ``pretrained_model_ema/`` holds and an evaluation with ``ema.use_for_eval`` rolls out. Frozen parameters and
        buffers stay the model's.

        Without ``gather`` the averages go in as they are (this rank's DTensor shards under FSDP, the EMA's own
        memory). With ``gather``, ``state`` is the full state dict gathered onto one rank (``full_state_dict`` and
        ``cpu_offload``; empty elsewhere) and ``receives`` says whether this rank is that one: each average is
        all-gathered (collective: every rank calls it, in the same order) and a new CPU tensor of it goes into
        ``state`` there.

        An average whose name ``state`` lacks is refused (RuntimeError), before anything is gathered: left out, the
        trained weight would stand where its average belongs, and the wrong weights would be saved or evaluated."""
        unknown = sorted(set(self.shadow) - set(state)) if receives else []
        if unknown:
            raise RuntimeError(f"the EMA holds parameters the model's state dict lacks: {unknown[:5]}")
        for name, average in self.shadow.items():
            if not gather:
                state[name] = average
                continue
            # A sharded average is all-gathered; a plain one (an ignored module's) copied: the copy is what a save
            # writes while training goes on.
            full = average.full_tensor() if isinstance(average, DTensor) else average.detach().clone()
            if receives:
                state[name] = full.cpu()
        return state

    def __iter__(self) -> Iterator[Tensor]:
        """The averages (DTensors under sharding): what lerobot_mg.distributed.memory counts."""
        return iter(self.shadow.values())

    def state(self) -> dict[str, int | float]:
        """The counters a checkpoint keeps (training_state/ema_state.json); the averages go to pretrained_model_ema/."""
        return {"updates": self.updates, "decay": self.decay}

    def load_state(self, state: dict[str, int | float]) -> None:
        self.updates, self.decay = int(state["updates"]), float(state["decay"])
