"""The config's own consistency: each check compares fields of one ``TrainConfig`` with each other.

What needs more than the config (the dataset, the device, the base at ``policy.path``, the checkpoint to resume,
the memory plan) is checked by :mod:`lerobot_mg.preflight`, which calls :func:`validate` first. Values outside a
fixed set (``checkpoint.format``, ``accelerator.mixed_precision``, ...) are typed with the enums of
:mod:`lerobot_mg.config.choices`, so Hydra refuses them at compose time. Each failure is a ``ConfigError`` naming
the dotted key, the bad value and the override that fixes it.
"""

from __future__ import annotations

from lerobot_mg.config.choices import BestMetric, CheckpointFormat, MixedPrecision, SchedulerType
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.errors import config_error

# Why a run is not sharded: the words of every refusal of a sharding-only setting (docs/sharding.md).
NOT_SHARDED = ("DDP: parallelism.dp_shard unset, or 1 on several processes; or one process started without a "
               "launcher, which has no process group")


def validate(cfg: TrainConfig, sharded: bool) -> None:
    """Raise ``ConfigError`` for the first user error in ``cfg``; ``sharded``: the resolved layout shards (FSDP2 or
    HSDP, see :mod:`lerobot_mg.distributed.parallel_dims`)."""
    for key in ("steps", "batch_size", "log_freq"):
        value = getattr(cfg, key)
        if value < 1:
            raise config_error(key, value, "must be >= 1", f"{key}=<a positive integer>")
    if cfg.num_workers < 0:
        raise config_error("num_workers", cfg.num_workers, "must be >= 0", "num_workers=0")
    if cfg.torch_threads is not None and cfg.torch_threads < 1:
        raise config_error("torch_threads", cfg.torch_threads, "must be >= 1 (or null for torch's default)",
                           "torch_threads=1")

    if cfg.logging.log_every_s < 0:
        raise config_error("logging.log_every_s", cfg.logging.log_every_s, "must be >= 0 (seconds between progress "
                           "lines when stdout is no terminal)", "logging.log_every_s=30")

    _validate_accelerator(cfg, sharded)
    _validate_checkpoint(cfg, sharded)
    _validate_data_and_optim(cfg)
    _validate_episodes(cfg)
    _validate_ema(cfg)
    _validate_eval(cfg)
    cfg.policy.validate()


def _validate_accelerator(cfg: TrainConfig, sharded: bool) -> None:
    acc = cfg.accelerator
    if acc.gradient_accumulation.steps < 1:
        raise config_error(
            "accelerator.gradient_accumulation.steps", acc.gradient_accumulation.steps, "must be >= 1",
            "accelerator.gradient_accumulation.steps=1",
        )
    if acc.process_group_timeout_s < 1:
        raise config_error(
            "accelerator.process_group_timeout_s", acc.process_group_timeout_s, "must be >= 1 second",
            "accelerator.process_group_timeout_s=600",
        )
    fsdp = acc.fsdp
    if not sharded:
        set_fields = [
            name
            for name, is_set in (
                ("wrap_modules", fsdp.wrap_modules is not None),
                ("min_num_params", fsdp.min_num_params is not None),
                ("cpu_offload", fsdp.cpu_offload),
                ("ignored_modules", fsdp.ignored_modules is not None),
                ("reshard_after_forward", not fsdp.reshard_after_forward),
                ("mixed_precision_policy", fsdp.mixed_precision_policy.is_set()),
            )
            if is_set
        ]
        # The unit rules also choose the blocks activation checkpointing and compile apply to, sharded or not.
        if acc.activation_checkpointing or acc.compile:
            set_fields = [name for name in set_fields if name not in ("wrap_modules", "min_num_params")]
        if set_fields:
            key = f"accelerator.fsdp.{set_fields[0]}"
            unit_rule = set_fields[0] in ("wrap_modules", "min_num_params")
            raise config_error(
                key, getattr(fsdp, set_fields[0]) if set_fields[0] != "mixed_precision_policy" else "set",
                "only applies to sharded runs"
                + (" (or to choose the units of accelerator.activation_checkpointing / accelerator.compile)"
                   if unit_rule else "")
                + f", and this run is not sharded ({NOT_SHARDED})",
                f"parallelism.dp_shard=-1 to shard, or remove {key}",
            )
    if fsdp.wrap_modules is not None and fsdp.min_num_params is not None:
        raise config_error(
            "accelerator.fsdp.min_num_params", fsdp.min_num_params,
            "cannot be combined with accelerator.fsdp.wrap_modules (choose one wrap policy)",
            "remove accelerator.fsdp.min_num_params or accelerator.fsdp.wrap_modules",
        )
    if fsdp.wrap_modules is not None and not fsdp.wrap_modules:
        raise config_error(
            "accelerator.fsdp.wrap_modules", [], "names no class: only the root would be wrapped",
            "accelerator.fsdp.wrap_modules='[\"MyBlock\"]'",
        )
    if fsdp.min_num_params is not None and fsdp.min_num_params < 1:
        raise config_error(
            "accelerator.fsdp.min_num_params", fsdp.min_num_params, "must be >= 1",
            "accelerator.fsdp.min_num_params=1000000",
        )
    mixed = cfg.policy.mixed_parameter_dtypes
    if sharded and mixed is not None and acc.mixed_precision == MixedPrecision.no:
        raise config_error(
            "accelerator.mixed_precision", acc.mixed_precision,
            f"{mixed} builds trainable parameters of two dtypes (bfloat16, and float32 norms and projections as "
            "LeRobot keeps them), and FSDP2 shards a unit only when they share one; mixed precision trains float32 "
            "master copies of them", "accelerator=bf16 (or an unsharded layout)",
        )
    policy = fsdp.mixed_precision_policy
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(policy, name)
        if value == "float16" and acc.mixed_precision != MixedPrecision.fp16:
            raise config_error(
                f"accelerator.fsdp.mixed_precision_policy.{name}", value,
                "float16 needs the loss scaler, which only accelerator.mixed_precision=fp16 builds",
                "accelerator.mixed_precision=fp16",
            )
    # The policy is built from its fields alone (the guide: "so set param_dtype too"): without param_dtype the
    # parameters are never cast and compute stays float32, which a reduce/output dtype alone does not say.
    unpaired = next((name for name in ("reduce_dtype", "output_dtype") if getattr(policy, name) is not None), None)
    if unpaired is not None and policy.param_dtype is None:
        raise config_error(
            f"accelerator.fsdp.mixed_precision_policy.{unpaired}", getattr(policy, unpaired),
            "is set without param_dtype: the policy is built from its fields alone, so parameters would not be cast "
            "for compute (float32 compute)",
            "accelerator.fsdp.mixed_precision_policy.param_dtype=bfloat16 (or the dtype to compute in)",
        )


def _validate_checkpoint(cfg: TrainConfig, sharded: bool) -> None:
    ckpt = cfg.checkpoint
    if ckpt.format != CheckpointFormat.safetensors and not sharded:
        raise config_error(
            "checkpoint.format", ckpt.format,
            f"DCP weight shards only exist for sharded runs; this run is not sharded ({NOT_SHARDED})",
            "checkpoint.format=safetensors, or shard with parallelism.dp_shard=-1 under a launcher (torchrun, accelerate "
            "launch, SLURM; on one process that is FSDP2 on a 1-rank mesh)",
        )
    if ckpt.save_freq < 1:
        raise config_error("checkpoint.save_freq", ckpt.save_freq, "must be >= 1", "checkpoint.save_freq=1000")
    # Gradients accumulated inside a window live only in .grad and are not checkpointed: every save, and the
    # end of the run, must fall on an accumulation boundary or a resume would silently drop micro-batches.
    accum = cfg.accelerator.gradient_accumulation.steps
    if cfg.steps % accum:
        raise config_error(
            "steps", cfg.steps,
            f"is not a multiple of accelerator.gradient_accumulation.steps={accum}: the last "
            f"{cfg.steps % accum} micro-batch(es) would never reach an optimizer update",
            f"steps={-(-cfg.steps // accum) * accum}",
        )
    if ckpt.save_checkpoint and ckpt.save_freq < cfg.steps and ckpt.save_freq % accum:
        raise config_error(
            "checkpoint.save_freq", ckpt.save_freq,
            f"is not a multiple of accelerator.gradient_accumulation.steps={accum}: a checkpoint inside an "
            "accumulation window cannot resume exactly (accumulated gradients are not saved)",
            f"checkpoint.save_freq={-(-ckpt.save_freq // accum) * accum}",
        )
    if ckpt.keep_last is not None and ckpt.keep_last < 1:
        raise config_error(
            "checkpoint.keep_last", ckpt.keep_last, "must be >= 1 (or null to keep all)", "checkpoint.keep_last=null"
        )


def _validate_data_and_optim(cfg: TrainConfig) -> None:
    betas = cfg.optimizer.betas
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise config_error("optimizer.betas", list(betas), "must be two values in [0, 1)", "optimizer.betas=[0.9,0.999]")
    if cfg.optimizer.lr <= 0:
        raise config_error("optimizer.lr", cfg.optimizer.lr, "must be > 0", "optimizer.lr=1e-4")
    if cfg.optimizer.grad_clip_norm < 0:
        raise config_error(
            "optimizer.grad_clip_norm", cfg.optimizer.grad_clip_norm, "must be >= 0 (0 disables clipping)",
            "optimizer.grad_clip_norm=10",
        )
    sched = cfg.scheduler
    if sched.num_warmup_steps < 0 or (sched.type != SchedulerType.none and sched.num_warmup_steps >= cfg.steps):
        raise config_error(
            "scheduler.num_warmup_steps", sched.num_warmup_steps, f"must be in [0, steps={cfg.steps})",
            "scheduler.num_warmup_steps=<fewer than steps>",
        )
    if not 0.0 <= sched.min_lr_ratio <= 1.0:
        raise config_error("scheduler.min_lr_ratio", sched.min_lr_ratio, "must be in [0, 1]", "scheduler.min_lr_ratio=0")


def _validate_episodes(cfg: TrainConfig) -> None:
    """Each list of episodes names an episode once: a dataset is read per episode, so a repeat would neither weigh
    it more nor be noticed (a typo for another episode, trained on silently)."""
    data = cfg.dataset
    lists = {"dataset.episodes": data.episodes,
             "dataset.val_episodes": data.val_episodes if isinstance(data.val_episodes, list) else None,
             **{f"dataset.sources.{i}.episodes": source.episodes for i, source in enumerate(data.sources or [])}}
    for key, episodes in lists.items():
        if episodes is None:
            continue
        episodes = list(episodes)
        repeated = sorted({episode for episode in episodes if episodes.count(episode) > 1})
        if repeated:
            once = list(dict.fromkeys(episodes))
            raise config_error(key, episodes, f"names episode{'s' if len(repeated) > 1 else ''} {repeated} more than "
                               "once (each episode is read once, so a repeat weighs nothing)",
                               f"{key}=[{','.join(str(episode) for episode in once)}], each episode once")


def _validate_ema(cfg: TrainConfig) -> None:
    """The EMA schedule's ranges (Diffusion Policy's: a positive power and inv_gamma, 0 <= min <= max < 1)."""
    ema = cfg.ema
    for key, fix in (("power", "ema.power=0.75"), ("inv_gamma", "ema.inv_gamma=1.0")):
        if not getattr(ema, key) > 0:
            raise config_error(f"ema.{key}", getattr(ema, key), "must be > 0", fix)
    if not 0.0 <= ema.max_decay < 1.0:
        raise config_error("ema.max_decay", ema.max_decay, "must be in [0, 1) (1 would never move the average)",
                           "ema.max_decay=0.9999")
    if not 0.0 <= ema.min_decay <= ema.max_decay:
        raise config_error("ema.min_decay", ema.min_decay, f"must be in [0, ema.max_decay={ema.max_decay}]",
                           "ema.min_decay=0.0")
    if ema.update_after_step < 0:
        raise config_error("ema.update_after_step", ema.update_after_step, "must be >= 0", "ema.update_after_step=0")


def _validate_eval(cfg: TrainConfig) -> None:
    """``eval.*``, ``dataset.val_episodes`` and ``checkpoint.keep_best``/``best_metric`` against each other. What
    needs the dataset (the episodes the split names, the simulation's task) is checked in preflight."""
    ev, val = cfg.eval, cfg.dataset.val_episodes
    for key in ("n_episodes", "n_video_episodes", "freq"):
        if getattr(ev, key) < 0:
            raise config_error(f"eval.{key}", getattr(ev, key), "must be >= 0", f"eval.{key}=0")
    for key in ("max_steps", "val_batches", "val_batch_size"):
        if getattr(ev, key) is not None and getattr(ev, key) < 1:
            raise config_error(f"eval.{key}", getattr(ev, key), "must be >= 1 (or null)", f"eval.{key}=null")
    if val is not None and not (
        (isinstance(val, int) and not isinstance(val, bool) and val >= 1)
        or (isinstance(val, list) and val and all(isinstance(e, int) and not isinstance(e, bool) for e in val))
    ):
        raise config_error("dataset.val_episodes", val, "must be a non-empty list of episode indices, or a count "
                           ">= 1 of episodes taken from the end of the dataset", "dataset.val_episodes=5")
    for key in ("val_batches", "val_batch_size"):
        if getattr(ev, key) is not None and val is None:
            raise config_error(f"eval.{key}", getattr(ev, key), "sizes the validation loss, and dataset.val_episodes "
                               "holds no episode out", f"dataset.val_episodes=<episodes or a count>, or drop eval.{key}")
    accum = cfg.accelerator.gradient_accumulation.steps
    if ev.freq % accum:
        raise config_error(
            "eval.freq", ev.freq,
            f"is not a multiple of accelerator.gradient_accumulation.steps={accum}: an evaluation inside an "
            "accumulation window would see weights half-way through an update",
            f"eval.freq={-(-ev.freq // accum) * accum}",
        )
    _validate_keep_best(cfg)


def _validate_keep_best(cfg: TrainConfig) -> None:
    ckpt = cfg.checkpoint
    if ckpt.keep_best is None:
        if ckpt.best_metric is not None:
            raise config_error("checkpoint.best_metric", ckpt.best_metric, "only ranks checkpoints for "
                               "checkpoint.keep_best, which is not set", "checkpoint.keep_best=1, or drop "
                               "checkpoint.best_metric")
        return
    if ckpt.keep_best < 1:
        raise config_error("checkpoint.keep_best", ckpt.keep_best, "must be >= 1 (or null)", "checkpoint.keep_best=1")
    if not ckpt.save_checkpoint or cfg.eval.freq == 0:
        raise config_error("checkpoint.keep_best", ckpt.keep_best,
                           "ranks the checkpoints of evaluation steps, and this run "
                           + ("saves none (checkpoint.save_checkpoint=false)" if not ckpt.save_checkpoint
                              else "evaluates only at its last step (eval.freq=0)"),
                           "eval.freq=<loop steps> with checkpoint.save_checkpoint=true, or checkpoint.keep_best=null")
    metric = cfg.best_metric()
    if metric is BestMetric.success_rate and cfg.eval.n_episodes == 0:
        raise config_error("checkpoint.best_metric", metric, "ranks by the success rate in simulation, and "
                           "eval.n_episodes=0 runs none", "eval.n_episodes=50, or checkpoint.best_metric=val_loss")
    if metric is BestMetric.val_loss and cfg.dataset.val_episodes is None:
        raise config_error("checkpoint.best_metric", metric, "ranks by the validation loss, and no "
                           "dataset.val_episodes are held out", "dataset.val_episodes=<episodes or a count>, or "
                           "checkpoint.best_metric=success_rate with eval.n_episodes > 0")
