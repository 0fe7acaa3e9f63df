"""The training recipe: the ``optimizer`` and ``scheduler`` groups, each policy's training preset, and how the two
combine into the values a run trains with.

LeRobot's rule (``use_policy_training_preset``, true by default): a policy brings its own optimizer and lr schedule
(ACT: AdamW at 1e-5 with its backbone as a parameter group of its own; Diffusion: Adam, betas (0.95, 0.999), a
500-step warm-up; pi0: AdamW at 2.5e-5 with a cosine decay over 30,000 steps ...). One difference from LeRobot, on
purpose: a key the config sets wins over the preset. Every field of these groups is unset (null) unless the
command line, an experiment or a ``optimizer=`` / ``scheduler=`` preset sets it; :func:`resolve_recipe` fills each
unset key from the policy's preset, else from :data:`DEFAULT_OPTIMIZER` / :data:`DEFAULT_SCHEDULER` (the preset is
off, or gives no value for that key). ``optimizer.lr=3e-4`` therefore trains the policy's recipe at 3e-4, while
LeRobot would ignore it; ``use_policy_training_preset=false`` is the recipe of the defaults and of what the config
sets, nothing from the policy.

The values filled are written back into the run's config (train_config.json holds the recipe actually used, and a
resume reuses it as recorded), and :class:`RecipeRecord` says which keys the preset gave.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace

from lerobot_mg.config.choices import OptimizerType, SchedulerType
from lerobot_mg.errors import config_error

logger = logging.getLogger(__name__)


@dataclass
class ParamGroupConfig:
    """An optimizer parameter group: the trainable parameters whose name contains ``match`` (e.g. ACT's
    ``model.backbone.``; under PEFT the names begin with ``base_model.model.``, which still contains it), trained at
    ``lr`` / ``weight_decay`` instead of the optimizer's (null: the optimizer's). A parameter goes to the first group
    that matches it; the others form the main group, which comes first in the optimizer."""

    match: str = ""
    lr: float | None = None
    weight_decay: float | None = None


@dataclass
class OptimizerConfig:
    """The optimizer; a key left null takes the policy preset's value (see the module doc), else the default."""

    type: OptimizerType | None = None  # adamw (decoupled weight decay) | adam (L2 penalty, Diffusion's preset)
    lr: float | None = None  # the peak lr; never scaled with the effective batch
    betas: list[float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    grad_clip_norm: float | None = None  # 0 disables clipping
    # Parameter groups with their own lr / weight decay (ACT's backbone); [] trains every parameter alike.
    param_groups: list[ParamGroupConfig] | None = None


@dataclass
class SchedulerConfig:
    """The lr schedule, stepped once per loop step; a key left null takes the policy preset's value, else the
    default.

    ``cosine``: linear warm-up to lr, then cosine decay to ``min_lr_ratio`` x lr at the last step. ``constant``: the
    warm-up, then lr. ``none``: lr throughout (no scheduler_state.json). ``diffuser_cosine``: LeRobot's ``diffuser``
    scheduler named ``cosine`` (diffusers' cosine with warm-up: from 0 up to lr in ``num_warmup_steps``, then cosine
    to 0 at the last step). ``cosine_decay_with_warmup``: LeRobot's schedule of pi0 / pi0.5 / SmolVLA: warm-up, then
    cosine from lr down to ``decay_lr`` over ``num_decay_steps``, then flat; a run shorter than ``num_decay_steps``
    scales both to its length, as LeRobot does (the config records the scaled values)."""

    type: SchedulerType | None = None
    # Linear warm-up steps. Unless set, they take at most a tenth of a run (cosine_decay_with_warmup scales its own).
    num_warmup_steps: int | None = None
    min_lr_ratio: float | None = None  # cosine: the floor, as a fraction of optimizer.lr
    num_decay_steps: int | None = None  # cosine_decay_with_warmup
    decay_lr: float | None = None  # cosine_decay_with_warmup: the lr at the end of the decay


@dataclass(frozen=True)
class TrainingPreset:
    """A policy's training recipe (``PolicyConfig.training_preset``): LeRobot's ``get_optimizer_preset()`` and
    ``get_scheduler_preset()`` in one, every field set (``SchedulerConfig(type=none)`` for a policy without a
    schedule, the other scheduler fields then null)."""

    optimizer: OptimizerConfig
    scheduler: SchedulerConfig


@dataclass
class RecipeRecord:
    """Where the optimizer / scheduler values came from: which policy's preset filled which of the keys the config
    left unset, and which keys the config set (the rest are lerobot_mg's defaults). Written when the config is
    resolved; a resumed run keeps it. Not an input."""

    preset: str | None = None  # the policy type; null: no preset was used
    preset_keys: list[str] = field(default_factory=list)  # e.g. optimizer.lr, scheduler.type
    config_keys: list[str] = field(default_factory=list)  # the keys the config (command line, experiment) set

    def source(self, group: str) -> str:
        """Where ``group``'s values came from, in words, for the banner."""
        from_preset = [key for key in self.preset_keys if key.startswith(f"{group}.")]
        from_config = [key for key in self.config_keys if key.startswith(f"{group}.")]
        config = f"{group}.* set by the config" if len(from_config) == len(_keys(group)) else (
            f"{', '.join(from_config)} set by the config")
        if from_preset:
            return f"policy preset {self.preset}" + (f"; {config}" if from_config else "")
        if from_config:
            return config + ("" if len(from_config) == len(_keys(group)) else ", the rest lerobot_mg's defaults")
        return "lerobot_mg's defaults"


# The values of a key neither the config nor the policy's preset sets (use_policy_training_preset=false, a policy
# without a preset): the recipe of lerobot_mg's trainer.
DEFAULT_OPTIMIZER = OptimizerConfig(type=OptimizerType.adamw, lr=1e-4, betas=[0.9, 0.999], eps=1e-8,
                                    weight_decay=1e-4, grad_clip_norm=10.0, param_groups=[])
DEFAULT_SCHEDULER = SchedulerConfig(type=SchedulerType.cosine, num_warmup_steps=100, min_lr_ratio=0.1,
                                    num_decay_steps=30_000, decay_lr=2.5e-6)


def flow_matching_preset(policy: object) -> TrainingPreset:
    """LeRobot 0.6.1's recipe of its flow-matching VLAs (pi0, pi0.5, SmolVLA; their config classes differ only in
    the numbers): AdamW at the policy's ``optimizer_*`` fields, ``cosine_decay_with_warmup`` at its
    ``scheduler_*`` fields, peaking at ``optimizer_lr``."""
    return TrainingPreset(
        OptimizerConfig(type=OptimizerType.adamw, lr=policy.optimizer_lr, betas=list(policy.optimizer_betas),
                        eps=policy.optimizer_eps, weight_decay=policy.optimizer_weight_decay,
                        grad_clip_norm=policy.optimizer_grad_clip_norm, param_groups=[]),
        SchedulerConfig(type=SchedulerType.cosine_decay_with_warmup, num_warmup_steps=policy.scheduler_warmup_steps,
                        num_decay_steps=policy.scheduler_decay_steps, decay_lr=policy.scheduler_decay_lr))


def _keys(group: str) -> list[str]:
    config = OptimizerConfig if group == "optimizer" else SchedulerConfig
    return [f"{group}.{f.name}" for f in fields(config)]


def _filled(config: OptimizerConfig | SchedulerConfig, preset: OptimizerConfig | SchedulerConfig | None,
            default: OptimizerConfig | SchedulerConfig, group: str) -> tuple[dict, list[str], list[str]]:
    """The values of ``config`` with each unset key filled, the keys ``preset`` filled and the keys ``config`` set."""
    values, from_preset, from_config = {}, [], []
    for f in fields(config):
        value = getattr(config, f.name)
        if value is not None:
            from_config.append(f"{group}.{f.name}")
        elif preset is not None and getattr(preset, f.name) is not None:
            value = getattr(preset, f.name)
            from_preset.append(f"{group}.{f.name}")
        values[f.name] = getattr(default, f.name) if value is None else value
    return values, from_preset, from_config


def scaled_decay(num_warmup_steps: int, num_decay_steps: int, steps: int) -> tuple[int, int]:
    """LeRobot's auto-scaling of cosine_decay_with_warmup (lerobot/optim/schedulers.py): a run of fewer ``steps``
    than ``num_decay_steps`` scales the warm-up by ``steps / num_decay_steps`` (rounded down) and decays over the
    whole run. Returns (warm-up steps, decay steps)."""
    if steps >= num_decay_steps:
        return num_warmup_steps, num_decay_steps
    return int(num_warmup_steps * (steps / num_decay_steps)), steps


def resolve_recipe(optimizer: OptimizerConfig, scheduler: SchedulerConfig, preset: TrainingPreset | None,
                   policy_type: str | None, steps: int) -> tuple[OptimizerConfig, SchedulerConfig, RecipeRecord]:
    """The optimizer and scheduler a run trains with: each unset key from ``preset`` (None: the preset is off or
    the policy has none), else the default; a cosine_decay_with_warmup schedule scaled to ``steps`` as LeRobot
    scales it. Resolving a resolved config changes nothing."""
    opt_values, opt_preset, opt_config = _filled(optimizer, preset and preset.optimizer, DEFAULT_OPTIMIZER, "optimizer")
    sched_values, sched_preset, sched_config = _filled(scheduler, preset and preset.scheduler, DEFAULT_SCHEDULER,
                                                       "scheduler")
    opt_values["betas"] = list(opt_values["betas"])
    opt_values["param_groups"] = [replace(group) for group in opt_values["param_groups"]]
    resolved_scheduler = SchedulerConfig(**sched_values)
    check_recipe_keys(OptimizerConfig(**opt_values), resolved_scheduler)
    if resolved_scheduler.type == SchedulerType.cosine_decay_with_warmup:
        warmup, decay = scaled_decay(resolved_scheduler.num_warmup_steps, resolved_scheduler.num_decay_steps, steps)
        if (warmup, decay) != (resolved_scheduler.num_warmup_steps, resolved_scheduler.num_decay_steps):
            if os.environ.get("RANK", "0") == "0":
                logger.info("cosine_decay_with_warmup scaled to steps=%d (LeRobot's rule): warm-up %d -> %d, decay "
                            "%d -> %d steps", steps, resolved_scheduler.num_warmup_steps, warmup,
                            resolved_scheduler.num_decay_steps, decay)
            resolved_scheduler = replace(resolved_scheduler, num_warmup_steps=warmup, num_decay_steps=decay)
    from_preset = opt_preset + sched_preset
    record = RecipeRecord(policy_type if from_preset else None, from_preset, opt_config + sched_config)
    return OptimizerConfig(**opt_values), resolved_scheduler, record


def check_recipe_keys(optimizer: OptimizerConfig, scheduler: SchedulerConfig) -> None:
    """The ranges of the keys the schedules and parameter groups add (lerobot_mg.config.validate checks lr, betas,
    clipping, the warm-up and min_lr_ratio); raised while the config is built, before a schedule divides by them."""
    if scheduler.type == SchedulerType.cosine_decay_with_warmup:
        if scheduler.num_decay_steps < 1:
            raise config_error("scheduler.num_decay_steps", scheduler.num_decay_steps, "must be >= 1",
                               "scheduler.num_decay_steps=30000")
        if scheduler.decay_lr < 0:
            raise config_error("scheduler.decay_lr", scheduler.decay_lr, "must be >= 0", "scheduler.decay_lr=2.5e-6")
    fix = "'optimizer.param_groups=[{match:model.backbone.,lr:1e-5}]', or optimizer.param_groups=[]"
    for index, group in enumerate(optimizer.param_groups):
        key = f"optimizer.param_groups[{index}]"
        if not group.match:
            raise config_error(f"{key}.match", group.match, "must name a part of the parameter names", fix)
        if group.lr is not None and group.lr <= 0:
            raise config_error(f"{key}.lr", group.lr, "must be > 0 (null: optimizer.lr)", fix)
        if group.weight_decay is not None and group.weight_decay < 0:
            raise config_error(f"{key}.weight_decay", group.weight_decay, "must be >= 0 (null: optimizer.weight_decay)",
                               fix)


def describe_recipe(optimizer: OptimizerConfig, scheduler: SchedulerConfig, record: RecipeRecord) -> list[str]:
    """The recipe in two lines for the banner, e.g. ``optimizer: AdamW lr 2.5e-05 betas (0.9, 0.95) eps 1e-08 wd
    0.01, clip 1.0 (policy preset pi0)``."""
    name = {OptimizerType.adamw: "AdamW", OptimizerType.adam: "Adam"}[OptimizerType(optimizer.type)]
    betas = f"({optimizer.betas[0]:g}, {optimizer.betas[1]:g})"
    groups = "".join(f", parameters matching {group.match!r}: lr {_lr(group.lr, optimizer.lr)} wd "
                     f"{_lr(group.weight_decay, optimizer.weight_decay)}" for group in optimizer.param_groups)
    clip = f"clip {optimizer.grad_clip_norm:g}" if optimizer.grad_clip_norm else "no clipping"
    lines = [f"optimizer: {name} lr {optimizer.lr:g} betas {betas} eps {optimizer.eps:g} wd "
             f"{optimizer.weight_decay:g}, {clip}{groups} ({record.source('optimizer')})"]
    sched_type = SchedulerType(scheduler.type)
    detail = {
        SchedulerType.none: "none (lr constant)",
        SchedulerType.constant: f"constant after {scheduler.num_warmup_steps} warm-up steps",
        SchedulerType.cosine: f"cosine, {scheduler.num_warmup_steps} warm-up steps, down to "
                              f"{scheduler.min_lr_ratio:g} x lr at the last step",
        SchedulerType.diffuser_cosine: f"diffuser_cosine, {scheduler.num_warmup_steps} warm-up steps, down to 0 at "
                                       "the last step",
        SchedulerType.cosine_decay_with_warmup: f"cosine_decay_with_warmup, {scheduler.num_warmup_steps} warm-up "
                                                f"steps, decay over {scheduler.num_decay_steps} steps to "
                                                f"{scheduler.decay_lr:g}",
    }[sched_type]
    lines.append(f"scheduler: {detail}, stepped once per loop step ({record.source('scheduler')})")
    return lines


def _lr(value: float | None, fallback: float) -> str:
    return f"{fallback if value is None else value:g}"
