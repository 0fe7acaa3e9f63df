"""Optimizer and learning-rate schedule. The schedule is stepped once per loop step, whatever the number of
processes or accumulation steps, and is never scaled with the effective batch."""

from __future__ import annotations

import math

import torch
from torch import nn

from lerobot_mg.config.schema import OptimizerConfig, SchedulerConfig


def make_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def lr_factor(cfg: SchedulerConfig, step: int, total_steps: int) -> float:
    """Multiplier of the base lr after ``step`` loop steps."""
    if cfg.type == "none":
        return 1.0
    if step < cfg.num_warmup_steps:
        return (step + 1) / (cfg.num_warmup_steps + 1)
    if cfg.type == "constant":
        return 1.0
    progress = (step - cfg.num_warmup_steps) / max(1, total_steps - cfg.num_warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR | None:
    if cfg.type == "none":
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step, total_steps))


def describe_schedule(opt_cfg: OptimizerConfig, cfg: SchedulerConfig, total_steps: int) -> dict:
    return {
        "type": cfg.type,
        "lr": opt_cfg.lr,
        "warmup_steps": cfg.num_warmup_steps,
        "min_lr_ratio": cfg.min_lr_ratio,
        "total_steps": total_steps,
        "stepped": "once per loop step",
    }


def apply_optimizer_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR | None,
                           cfg: OptimizerConfig) -> None:
    """After loading a checkpoint's optimizer state: hyper-parameters come from this run's config, so an override on
    the resume command line (e.g. optimizer.lr) takes effect. Unchanged values give the same numbers as before."""
    for group in optimizer.param_groups:
        group.update(initial_lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr
        return
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
