"""Optimizer and learning-rate schedule. The schedule is stepped once per loop step, whatever the number of
processes or accumulation steps, and is never scaled with the effective batch."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

import torch
from torch import nn

from lerobot_mg.config.schema import OptimizerConfig, SchedulerConfig

logger = logging.getLogger(__name__)

# A warm-up the user did not type (a preset's, e.g. conf/scheduler/cosine.yaml's 100 steps, written for the default
# 2,000-step run) takes at most this share of the run: a short debug run (steps=8) or a shorter run than the preset
# had in mind scales it down instead of failing, as LeRobot's cosine scheduler scales its warm-up to a short run.
MAX_DEFAULT_WARMUP_SHARE = 0.1


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


def fit_warmup(cfg: SchedulerConfig, steps: int, typed: bool) -> SchedulerConfig:
    """``cfg`` with a warm-up the user did not type scaled down to ``MAX_DEFAULT_WARMUP_SHARE`` of ``steps``
    where it is longer (and the change logged); a typed warm-up is kept as typed (validation refuses one that
    does not fit)."""
    fitted = int(steps * MAX_DEFAULT_WARMUP_SHARE)
    if typed or cfg.type == "none" or cfg.num_warmup_steps <= fitted:
        return cfg
    if os.environ.get("RANK", "0") == "0":
        logger.info(
            "scheduler.num_warmup_steps=%d (not typed: the preset's) is more than %d%% of steps=%d: scaled down to "
            "%d warm-up steps. Type scheduler.num_warmup_steps=<N> to choose it yourself.",
            cfg.num_warmup_steps, round(100 * MAX_DEFAULT_WARMUP_SHARE), steps, fitted,
        )
    return replace(cfg, num_warmup_steps=fitted)


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
