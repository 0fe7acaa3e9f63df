"""Optimizer and learning-rate schedule of a resolved recipe (lerobot_mg.config.recipe: the policy's training preset
under the keys the config sets). The schedule is stepped once per loop step, whatever the number of processes or
accumulation steps, and is never scaled with the effective batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lerobot_mg.config.choices import OptimizerType, SchedulerType
from lerobot_mg.config.recipe import OptimizerConfig, SchedulerConfig, scaled_decay

MAIN_GROUP = "main"


@dataclass(frozen=True)
class GroupSettings:
    """The hyper-parameters of one optimizer parameter group, by its name (``main``, or the ``match`` of an
    ``optimizer.param_groups`` entry)."""

    name: str
    lr: float
    weight_decay: float


def group_settings(cfg: OptimizerConfig) -> list[GroupSettings]:
    """The main group first, then each of ``cfg.param_groups``: the optimizer's groups in order."""
    return [GroupSettings(MAIN_GROUP, cfg.lr, cfg.weight_decay), *(
        GroupSettings(group.match, cfg.lr if group.lr is None else group.lr,
                      cfg.weight_decay if group.weight_decay is None else group.weight_decay)
        for group in cfg.param_groups)]


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """The trainable parameters split into ``cfg``'s groups (a parameter goes to the first ``param_groups`` entry
    whose ``match`` its name contains, else to the main group), each group named and with its lr and weight decay.
    A group no parameter matches is left out (e.g. ACT's backbone group on a policy without a camera)."""
    settings = group_settings(cfg)
    members: list[list[nn.Parameter]] = [[] for _ in settings]
    for name, param in model.named_parameters():
        if param.requires_grad:
            index = next((i for i, group in enumerate(settings[1:], 1) if group.name in name), 0)
            members[index].append(param)
    return [{"params": params, "name": group.name, "lr": group.lr, "weight_decay": group.weight_decay}
            for group, params in zip(settings, members) if params or group.name == MAIN_GROUP]


def make_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    optimizer_class = {OptimizerType.adamw: torch.optim.AdamW, OptimizerType.adam: torch.optim.Adam}[
        OptimizerType(cfg.type)]
    return optimizer_class(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                           weight_decay=cfg.weight_decay)


def lr_factor(scheduler: SchedulerConfig, lr: float, step: int, total_steps: int) -> float:
    """Multiplier of each parameter group's lr after ``step`` loop steps of a ``total_steps`` run; ``lr`` is the
    optimizer's (cosine_decay_with_warmup decays to ``decay_lr / lr`` of it: LeRobot's ``decay_lr / peak_lr``)."""
    sched_type = SchedulerType(scheduler.type)
    warmup = scheduler.num_warmup_steps
    if sched_type == SchedulerType.none:
        return 1.0
    if sched_type == SchedulerType.cosine_decay_with_warmup:  # lerobot/optim/schedulers.py
        warmup, decay = scaled_decay(warmup, scheduler.num_decay_steps, total_steps)
        if step < warmup:  # linear from 1 / (warmup + 1) at step 0 up to 1 at step `warmup`
            start = 1 / (warmup + 1)
            return start if step <= 0 else start + (1 - start) * step / warmup
        floor = scheduler.decay_lr / lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step, decay) / decay))
    if sched_type == SchedulerType.diffuser_cosine:  # diffusers' get_cosine_schedule_with_warmup, half a cycle
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total_steps - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if sched_type == SchedulerType.constant:
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return scheduler.min_lr_ratio + (1.0 - scheduler.min_lr_ratio) * cosine


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig,
                   total_steps: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The schedule of ``cfg`` over a ``total_steps`` run, relative to the lr of ``optimizer``'s first (main)
    group, the optimizer's lr (the peak of cosine_decay_with_warmup)."""
    if cfg.type == SchedulerType.none:
        return None
    lr = optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, lr, step, total_steps))


def describe_schedule(opt_cfg: OptimizerConfig, cfg: SchedulerConfig, total_steps: int) -> dict:
    """The recipe as the run facts record it (train_config.json's run_facts, lerobot-mg-compare, the resume's check
    of what changed): the values actually trained with. Where they came from is the config's training_recipe."""
    described = {
        "type": cfg.type,
        "optimizer": opt_cfg.type,
        "lr": opt_cfg.lr,
        "betas": list(opt_cfg.betas),
        "eps": opt_cfg.eps,
        "weight_decay": opt_cfg.weight_decay,
        "grad_clip_norm": opt_cfg.grad_clip_norm,
        "warmup_steps": cfg.num_warmup_steps,
    }
    if cfg.type == SchedulerType.cosine:
        described["min_lr_ratio"] = cfg.min_lr_ratio
    if cfg.type == SchedulerType.cosine_decay_with_warmup:
        described.update(decay_steps=cfg.num_decay_steps, decay_lr=cfg.decay_lr)
    if opt_cfg.param_groups:
        described["param_groups"] = [{"match": g.name, "lr": g.lr, "weight_decay": g.weight_decay}
                                     for g in group_settings(opt_cfg)[1:]]
    described.update(total_steps=total_steps, stepped="once per loop step")
    return described


def apply_optimizer_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR | None,
                           cfg: OptimizerConfig) -> None:
    """After loading a checkpoint's optimizer state: hyper-parameters come from this run's config, so an override on
    the resume command line (e.g. optimizer.lr) takes effect. Unchanged values give the same numbers as before."""
    settings = {group.name: group for group in group_settings(cfg)}
    for group in optimizer.param_groups:
        own = settings[group.get("name", MAIN_GROUP)]
        group.update(initial_lr=own.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                     weight_decay=own.weight_decay)
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        return
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
