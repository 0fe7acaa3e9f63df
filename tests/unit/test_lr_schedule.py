"""The schedule is stepped once per loop step on purpose (the guide's rule), also under gradient accumulation: each
optimizer update uses the lr the schedule defines for its loop step, and torch's warning about the scheduler stepping
before the optimizer (which accelerate skips inside an accumulation window) is not shown."""

from __future__ import annotations

import warnings

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from lerobot_mg.config.recipe import OptimizerConfig, SchedulerConfig, resolve_recipe
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.optim import lr_factor, make_optimizer, make_scheduler
from lerobot_mg.step import Stepper


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        return ((self.linear(batch["x"]) - batch["y"]) ** 2).mean(), {}


@pytest.mark.parametrize("scheduler_type", ["cosine", "constant"])
def test_each_update_uses_the_lr_of_its_loop_step_and_torch_does_not_warn(scheduler_type: str) -> None:
    steps, accumulation = 12, 4
    opt_cfg, sched_cfg, _ = resolve_recipe(
        OptimizerConfig(lr=1e-2), SchedulerConfig(type=scheduler_type, num_warmup_steps=5, min_lr_ratio=0.1),
        preset=None, policy_type=None, steps=steps)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = Regression()
    optimizer = make_optimizer(model, opt_cfg)
    scheduler = make_scheduler(optimizer, sched_cfg, steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    stepper = Stepper(accelerator, model, optimizer, scheduler, lambda batch: batch, 0.0,
                      ParallelDims.resolve(1, 1, 1, 0, 0))
    update_lrs: list[float] = []  # the lr torch's AdamW reads at each real update
    inner = optimizer.optimizer
    inner.register_step_pre_hook(lambda opt, args, kwargs: update_lrs.append(opt.param_groups[0]["lr"]))
    logged = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            batch = {"x": torch.randn(4, 3), "y": torch.randn(4, 1)}
            logs = stepper.step(batch)
            logged.append((logs.synced, logs.lr))
    update_steps = [step for step in range(steps) if (step + 1) % accumulation == 0]  # loop steps 3, 7, 11
    expected = [opt_cfg.lr * lr_factor(sched_cfg, opt_cfg.lr, step, steps) for step in update_steps]
    assert update_lrs == pytest.approx(expected, rel=1e-12)
    assert [lr for synced, lr in logged if synced] == pytest.approx(expected, rel=1e-12)  # what the ledger records
    if scheduler_type == "cosine":  # the schedule moved between updates: a stale lr would not match
        assert len(set(expected)) == len(expected)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]
