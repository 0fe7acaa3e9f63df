"""One loop step for every layout: forward, backward, and on accumulation boundaries the optimizer update.

Gradient accumulation keeps a sharded run's gradients sharded: under FSDP2 and HSDP every micro-batch's backward
reduce-scatters (each rank accumulates only its shard of the gradients); HSDP defers only the all-reduce across
replicas to the window's last micro-batch. DDP accumulates full local gradients under ``no_sync`` and all-reduces
once per window, as before.

A step never waits for the device: its losses, gradient norm and skip flag stay device tensors
(:class:`StepLogs`), summed between log steps and read there (lerobot_mg.tracking). The one exception is torch's
fp16 loss scaler, whose ``step()`` reads the overflow flag once per optimizer update. The marks that time its
phases (preprocessing, update: lerobot_mg.accounting.throughput) are CUDA events on a GPU, read at log steps too.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from lerobot_mg.accounting.throughput import Mark, StepClock
from lerobot_mg.config.schema import EMAConfig
from lerobot_mg.distributed.accelerator import ignored_trainable_params, sync_found_inf, sync_ignored_grads
from lerobot_mg.distributed.parallel_dims import Layout, ParallelDims
from lerobot_mg.ema import ModelEMA
from lerobot_mg.policies.base import SAMPLE_SEED_KEY

# torch's warning when LRScheduler.step() runs before the optimizer's first step (torch/optim/lr_scheduler.py).
_SCHEDULER_BEFORE_OPTIMIZER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


@dataclass
class StepLogs:
    """What one loop step did; :meth:`Stepper.step` fills it in."""

    # Device tensors (0-d): converting one to a Python number waits for the device.
    losses: dict[str, torch.Tensor] = field(default_factory=dict, init=False)
    # This loop step ended an accumulation window: an optimizer update was attempted ...
    synced: bool = field(default=False, init=False)
    # ... and the fp16 loss scaler skipped it (inf/nan gradients on some rank): a device bool tensor under fp16.
    skipped: bool | torch.Tensor = field(default=False, init=False)
    grad_norm: float | torch.Tensor = field(default=math.nan, init=False)  # a device tensor when clipping
    # The learning rate this step's update used (before the scheduler stepped).
    lr: float = field(default=math.nan, init=False)
    # When the step began, its forward began (the batch on the device, preprocessed) and its update ended
    # (lerobot_mg.accounting.throughput.StepClock: CUDA events on a GPU, read only at log steps).
    marks: tuple[Mark, Mark, Mark] | None = field(default=None, init=False)


# Read on the host by the policies (per-sample generators): on the device, reading them would wait for it.
HOST_KEYS = frozenset({SAMPLE_SEED_KEY})


def to_device(batch: dict[str, Any], device: torch.device, uint8_keys: Collection[str] = ()) -> dict[str, Any]:
    """The batch on ``device``; ``uint8_keys`` (images that crossed the DataLoader's pipes as uint8, a quarter of the
    bytes of float32) become float32 in [0, 1] there, as the policy expects them."""
    out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in HOST_KEYS else v
           for k, v in batch.items()}
    for key in uint8_keys:
        out[key] = out[key].float().div_(255.0)
    return out


def make_ema(model: nn.Module, cfg: EMAConfig) -> ModelEMA | None:
    """The moving average of ``model``'s trainable weights that :class:`Stepper` updates after every optimizer update
    (None unless ``ema.enable``). ``model`` is the unwrapped policy, already sharded: each rank averages its own
    shards."""
    return ModelEMA.of(cfg, model)


class Stepper:
    """Runs loop steps. Every method is collective: every rank calls it once per loop step.

    ``ema``, if given, averages the weights after every optimizer update (an fp16 update the loss scaler skipped too:
    the average then moves towards unchanged weights)."""

    def __init__(self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, preprocessor: Any, grad_clip_norm: float,
                 dims: ParallelDims, uint8_keys: Collection[str] = (), ema: ModelEMA | None = None):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.preprocessor = preprocessor
        self.grad_clip_norm = grad_clip_norm  # optimizer.grad_clip_norm; 0 disables clipping
        self.dims = dims
        self.uint8_keys = tuple(uint8_keys)  # see to_device
        # FSDP leaves these as plain tensors and does not reduce their gradients (accelerator.fsdp.ignored_modules).
        self.ignored_params = ignored_trainable_params(model) if dims.is_sharded else []
        self.ema = ema
        # HSDP accumulates each micro-batch's reduce-scattered shard within its replica and all-reduces across the
        # replicas once per window (lerobot_mg.distributed.accelerator.accumulation_plugin).
        self.defer_replica_reduce = dims.layout is Layout.HSDP and accelerator.gradient_accumulation_steps > 1
        self.clock = StepClock(accelerator.device)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, batch: dict[str, Any]) -> StepLogs:
        acc = self.accelerator
        began = self.clock.mark()
        batch = self.preprocessor(to_device(batch, acc.device, self.uint8_keys))
        forward_began = self.clock.mark()
        logs = StepLogs()
        with acc.accumulate(self.model):
            if self.defer_replica_reduce:
                self.model.set_requires_all_reduce(acc.sync_gradients)
            loss, policy_logs = self.model(batch)
            self.backward(loss)
            logs.synced = acc.sync_gradients
            if logs.synced:
                logs.grad_norm = self._finish_gradients()
                # The scale as a device tensor (get_scale() would read it on the host).
                scale_before = acc.scaler._get_scale_async().clone() if acc.scaler is not None else None
            self.optimizer.step()  # accelerate skips it inside an accumulation window
            self.optimizer.zero_grad(set_to_none=True)
            if logs.synced and self.ema is not None:
                self.ema.update()  # local to each rank's shards, no host sync
            if logs.synced and scale_before is not None:
                logs.skipped = acc.scaler._get_scale_async() < scale_before  # it backs off exactly on a skip
        logs.marks = (began, forward_began, self.clock.mark())
        logs.lr = self.lr
        if self.scheduler is not None:
            with warnings.catch_warnings():
                # Stepped once per loop step on purpose (the guide's rule, said once in the banner): inside an
                # accumulation window accelerate skips optimizer.step(), and torch warns that the schedule ran
                # ahead of the optimizer. The lr each update uses is still the schedule's for its loop step.
                warnings.filterwarnings("ignore", message=_SCHEDULER_BEFORE_OPTIMIZER, category=UserWarning)
                self.scheduler.step()  # once per loop step, whatever the process count
        logs.losses = {"loss": loss.detach(), **policy_logs}
        return logs

    def backward(self, loss: torch.Tensor) -> None:
        """The backward of this loop step's micro-batch (accelerate scales the loss for accumulation and fp16). A
        fault drill extends it (lerobot_mg.drills.DrillStepper)."""
        self.accelerator.backward(loss)

    def _finish_gradients(self) -> float | torch.Tensor:
        """Reduce what FSDP does not, unscale, agree on overflow, clip; returns the global grad norm (a device
        tensor; NaN when clipping is off)."""
        acc = self.accelerator
        sync_ignored_grads(self.ignored_params, self.dims.world_size)
        norm = math.nan
        if self.grad_clip_norm > 0:
            total = acc.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)  # unscales first under fp16
            total = total.full_tensor() if hasattr(total, "full_tensor") else total
            norm = total.detach()
        elif acc.scaler is not None:
            acc.unscale_gradients()
        sync_found_inf(acc, self.optimizer)
        return norm
