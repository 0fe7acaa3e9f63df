"""Every user-facing config check, in one place, run on every rank before any process group exists.

Each failure is a ``ConfigError`` (lerobot_mg/errors.py) naming the dotted key, the bad value and the override that fixes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.data.lerobot_dataset import episode_lengths, read_info
from lerobot_mg.distributed.wrap import check_wrap_classes, compile_unavailable_reason
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies.base import features_from_dataset

MIXED_PRECISIONS = ("no", "bf16", "fp16")
CHECKPOINT_FORMATS = ("safetensors", "dcp", "safetensors_dcp")
TORCH_DTYPES = ("float32", "bfloat16", "float16")
DATASET_NAMES = ("embedded", "lerobot")
SCHEDULERS = ("none", "constant", "cosine")
WANDB_MODES = ("offline", "online", "disabled")


def config_error(key: str, value: object, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {problem}. Fix: {fix}")


def report_user_error(error: ConfigError) -> None:
    """The one line a user error prints (the command then exits with status 2)."""
    print(f"lerobot-mg-train: error: {error}", file=sys.stderr, flush=True)


def resolve_dp_degrees(dp_replicate: int, dp_shard: int, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) actually used on ``world_size`` processes; raises on an impossible layout.

    Both 1 means DDP: every process is a replica. ``dp_shard=-1`` shards over all processes left after
    ``dp_replicate``.
    """
    if dp_replicate < 1:
        raise config_error("parallelism.dp_replicate", dp_replicate, "must be >= 1", "parallelism.dp_replicate=1")
    if dp_shard == 0 or dp_shard < -1:
        raise config_error(
            "parallelism.dp_shard", dp_shard, "must be >= 1, or -1 for all processes", "parallelism.dp_shard=-1"
        )
    if dp_replicate == 1 and dp_shard == 1:
        return world_size, 1
    if dp_shard == -1:
        if world_size % dp_replicate:
            raise config_error(
                "parallelism.dp_replicate",
                dp_replicate,
                f"does not divide the {world_size} processes the launcher started (dp_shard=-1 shards over "
                f"world_size / dp_replicate)",
                f"parallelism.dp_replicate=<a divisor of {world_size}>",
            )
        if dp_replicate > 1 and world_size == dp_replicate:
            raise config_error(
                "parallelism.dp_shard", dp_shard,
                f"shards over world_size / dp_replicate = {world_size} / {dp_replicate} = 1 rank: that is plain "
                "replication (DDP), not HSDP",
                f"launch {2 * dp_replicate}+ processes for HSDP, or parallelism=ddp for DDP",
            )
        return dp_replicate, world_size // dp_replicate
    if dp_replicate * dp_shard != world_size:
        raise config_error(
            "parallelism",
            {"dp_replicate": dp_replicate, "dp_shard": dp_shard},
            f"dp_replicate x dp_shard = {dp_replicate * dp_shard} but the launcher started {world_size} "
            f"process(es); the two degrees must multiply to the world size",
            f"parallelism.dp_shard=-1 (shard over all processes), or launch {dp_replicate * dp_shard} processes "
            f"(torchrun --nproc-per-node=...)",
        )
    return dp_replicate, dp_shard


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Raise ``ConfigError`` for the first user error in ``cfg`` for a launch of ``world_size`` processes."""
    for key in ("steps", "batch_size", "log_freq"):
        value = getattr(cfg, key)
        if value < 1:
            raise config_error(key, value, "must be >= 1", f"{key}=<a positive integer>")
    if cfg.num_workers < 0:
        raise config_error("num_workers", cfg.num_workers, "must be >= 0", "num_workers=0")
    if cfg.torch_threads is not None and cfg.torch_threads < 1:
        raise config_error("torch_threads", cfg.torch_threads, "must be >= 1 (or null for torch's default)",
                           "torch_threads=1")

    dp_replicate, dp_shard = resolve_dp_degrees(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, world_size)
    sharded = dp_shard > 1
    _validate_accelerator(cfg, sharded)
    _validate_checkpoint(cfg, sharded)
    _validate_data_and_optim(cfg)
    _validate_resume_and_output(cfg)
    cfg.policy.validate()
    _validate_finetune(cfg, sharded)
    _validate_dataset(cfg, dp_replicate * dp_shard)


def _validate_accelerator(cfg: TrainConfig, sharded: bool) -> None:
    acc = cfg.accelerator
    if acc.mixed_precision not in MIXED_PRECISIONS:
        raise config_error(
            "accelerator.mixed_precision", acc.mixed_precision, f"must be one of {MIXED_PRECISIONS}",
            "accelerator.mixed_precision=bf16",
        )
    unsupported = precision_unsupported(acc.mixed_precision, use_cpu=acc.cpu or not torch.cuda.is_available())
    if unsupported is not None:
        raise config_error("accelerator.mixed_precision", acc.mixed_precision, *unsupported)
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
    if acc.compile:
        reason = compile_unavailable_reason(use_cpu=acc.cpu or not torch.cuda.is_available())
        if reason is not None:
            raise config_error("accelerator.compile", True, reason, "accelerator.compile=false")
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
                + ", and this run is not sharded (parallelism.dp_shard=1)",
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
    policy = fsdp.mixed_precision_policy
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(policy, name)
        if value is not None and value not in TORCH_DTYPES:
            raise config_error(
                f"accelerator.fsdp.mixed_precision_policy.{name}", value, f"must be one of {TORCH_DTYPES}",
                f"accelerator.fsdp.mixed_precision_policy.{name}=bfloat16",
            )
        if value == "float16" and acc.mixed_precision != "fp16":
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
    if ckpt.format not in CHECKPOINT_FORMATS:
        fix = ckpt.format.lower() if ckpt.format.lower() in CHECKPOINT_FORMATS else "safetensors"
        raise config_error(
            "checkpoint.format", ckpt.format, f"must be one of {CHECKPOINT_FORMATS} (lower case)",
            f"checkpoint.format={fix}",
        )
    if ckpt.format != "safetensors" and not sharded:
        raise config_error(
            "checkpoint.format", ckpt.format,
            "DCP weight shards only exist for sharded runs; this run is not sharded (parallelism.dp_shard=1)",
            "checkpoint.format=safetensors, or shard with parallelism.dp_shard=-1",
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
    if cfg.dataset.name not in DATASET_NAMES:
        raise config_error("dataset.name", cfg.dataset.name, f"must be one of {DATASET_NAMES}", "dataset=lerobot")
    if cfg.optimizer.type != "adamw":
        raise config_error("optimizer.type", cfg.optimizer.type, "only adamw is available", "optimizer=adamw")
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
    if sched.type not in SCHEDULERS:
        raise config_error("scheduler.type", sched.type, f"must be one of {SCHEDULERS}", "scheduler=cosine")
    if sched.num_warmup_steps < 0 or (sched.type != "none" and sched.num_warmup_steps >= cfg.steps):
        raise config_error(
            "scheduler.num_warmup_steps", sched.num_warmup_steps, f"must be in [0, steps={cfg.steps})",
            "scheduler.num_warmup_steps=<fewer than steps>",
        )
    if not 0.0 <= sched.min_lr_ratio <= 1.0:
        raise config_error("scheduler.min_lr_ratio", sched.min_lr_ratio, "must be in [0, 1]", "scheduler.min_lr_ratio=0")
    if cfg.logging.wandb.mode not in WANDB_MODES:
        raise config_error(
            "logging.wandb.mode", cfg.logging.wandb.mode, f"must be one of {WANDB_MODES}",
            "logging.wandb.mode=offline",
        )
    if cfg.eval.n_episodes < 0:
        raise config_error("eval.n_episodes", cfg.eval.n_episodes, "must be >= 0", "eval.n_episodes=0")
    if cfg.eval.n_video_episodes < 0:
        raise config_error("eval.n_video_episodes", cfg.eval.n_video_episodes, "must be >= 0", "eval.n_video_episodes=0")
    if cfg.eval.n_episodes > 0 and (not cfg.checkpoint.save_checkpoint or cfg.checkpoint.format == "dcp"):
        raise config_error(
            "eval.n_episodes", cfg.eval.n_episodes,
            "evaluation loads the last checkpoint's model.safetensors, which this run does not write",
            "checkpoint.save_checkpoint=true with checkpoint.format=safetensors or safetensors_dcp, or eval.n_episodes=0",
        )
    if cfg.eval.n_episodes > 0 and cfg.dataset.name != "embedded":
        raise config_error(
            "eval.n_episodes", cfg.eval.n_episodes,
            "evaluation runs the ALOHA transfer-cube simulation, which only matches the embedded dataset",
            "eval.n_episodes=0, or dataset=embedded",
        )


def _validate_dataset(cfg: TrainConfig, dp_world_size: int) -> None:
    """The dataset's metadata (meta/info.json, the episodes table) against the policy and the batch, before any
    process group exists: the version, the features the policy reads, episode lengths and the number of samples."""
    root = Path(cfg.dataset.root)
    if not (root / "meta" / "info.json").is_file():
        fix = (
            "generate it first: lerobot-mg-make-dataset (or make train does it)"
            if cfg.dataset.name == "embedded"
            else "dataset.root=<a LeRobot v3.0 dataset directory containing meta/info.json>"
        )
        raise config_error("dataset.root", str(root), "is not a LeRobot v3.0 dataset (no meta/info.json)", fix)
    info = read_info(root)
    features_from_dataset(info["features"], cfg.policy.observation_keys)  # policy.observation_keys it lacks
    lengths = episode_lengths(root)
    if cfg.dataset.episodes is not None:
        unknown = sorted(set(cfg.dataset.episodes) - set(lengths))
        if unknown:
            raise config_error(
                "dataset.episodes", list(cfg.dataset.episodes),
                f"dataset.root has no episode {unknown} (it has {len(lengths)}: {min(lengths)}..{max(lengths)})",
                f"dataset.episodes=<indices in {min(lengths)}..{max(lengths)}>, or dataset.episodes=null for all",
            )
        lengths = {index: lengths[index] for index in cfg.dataset.episodes}
    chunk = len(cfg.policy.action_delta_indices)
    shortest = min(lengths.values())
    if chunk > shortest:
        key = f"policy.{cfg.policy.action_length_key}"
        raise config_error(
            key, getattr(cfg.policy, cfg.policy.action_length_key),
            f"each sample loads {chunk} action frames, more than the shortest episode of dataset.root has "
            f"({shortest} frames, episode {min(lengths, key=lengths.__getitem__)}): most of its chunks would be padding",
            f"{key}=<at most {shortest}>, or dataset.episodes=<longer episodes>",
        )
    num_samples = sum(lengths.values())
    if dp_world_size > num_samples:
        raise config_error(
            "dataset.root", str(root),
            f"has {num_samples} samples, fewer than the {dp_world_size} data-parallel ranks launched: some ranks "
            "would get no sample at all",
            f"launch at most {num_samples} processes, or a larger dataset",
        )
    if cfg.batch_size * dp_world_size > num_samples:
        raise config_error(
            "batch_size", cfg.batch_size,
            f"one global batch (batch_size x {dp_world_size} data-parallel ranks = {cfg.batch_size * dp_world_size} "
            f"samples) is larger than the {num_samples} samples of dataset.root",
            f"batch_size={num_samples // dp_world_size}, or fewer processes",
        )
    wrap_modules = cfg.accelerator.fsdp.wrap_modules
    if wrap_modules and cfg.policy.path is None and not cfg.peft.enabled:
        from lerobot_mg.policies.registry import make_policy

        with torch.device("meta"):  # the module classes only: no memory, no draw from the random generator
            check_wrap_classes(make_policy(cfg.policy, info["features"]), wrap_modules)


def precision_unsupported(mixed_precision: str, use_cpu: bool) -> tuple[str, str] | None:
    """(why this device cannot compute in ``mixed_precision``, the setting it can) or None when it can.

    A GPU that lacks the arithmetic would otherwise fail deep in the first forward (fp16 before compute capability
    5.3) or, for bf16 before 8.0, run torch's slow emulation without saying so.
    """
    if mixed_precision == "no":
        return None
    device = "cpu" if use_cpu else "cuda"
    if not torch.amp.is_autocast_available(device):
        return f"this torch build has no autocast for {device}", "accelerator.mixed_precision=no"
    if use_cpu:  # CPU autocast computes in both (fp16 with the loss scaler distributed/accelerator.py builds)
        return None
    capability = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]})"
    has_fp16 = capability >= (5, 3)
    if mixed_precision == "fp16" and not has_fp16:
        return f"{gpu} has no fp16 arithmetic (compute capability 5.3 or later)", "accelerator.mixed_precision=no"
    if mixed_precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return (f"{gpu} has no native bf16 (compute capability 8.0 or later); torch would emulate it slowly",
                f"accelerator.mixed_precision={'fp16' if has_fp16 else 'no'}")
    return None


def _validate_finetune(cfg: TrainConfig, sharded: bool) -> None:
    """``policy.path`` and ``peft.*``: the base on disk and the module names it has."""
    if cfg.policy.path is None and not cfg.peft.enabled:
        return
    from lerobot_mg.peft.base import check_policy_path, stored_dtype
    from lerobot_mg.peft.lora import check_peft_config

    if cfg.policy.path is not None:
        check_policy_path(cfg.policy.path)
    if cfg.peft.enabled:
        check_peft_config(cfg, sharded)
        dtype = stored_dtype(str(cfg.policy.path))
        if sharded and dtype in (torch.bfloat16, torch.float16) and cfg.accelerator.mixed_precision == "no":
            raise config_error(
                "accelerator.mixed_precision", cfg.accelerator.mixed_precision,
                f"the base at policy.path is stored in {str(dtype).removeprefix('torch.')}, and FSDP2 shards the "
                "fp32 LoRA adapters with it; with mixed precision on, every trainable parameter is upcast to fp32",
                f"accelerator.mixed_precision={'fp16' if dtype == torch.float16 else 'bf16'}",
            )


def check_resume_request(resume: bool, config_path: str | None) -> None:
    """The resume inputs alone; also called before the saved config is read (config.loading)."""
    if resume:
        if config_path is None:
            raise config_error(
                "config_path", None, "resume=true needs the train_config.json of the checkpoint to resume",
                "config_path=<run>/checkpoints/last/pretrained_model/train_config.json",
            )
        if not Path(config_path).is_file():
            raise config_error(
                "config_path", config_path,
                "is a directory, not the train_config.json file in it" if Path(config_path).is_dir()
                else "does not exist",
                "config_path=<run>/checkpoints/last/pretrained_model/train_config.json",
            )
    elif config_path is not None:
        raise config_error("config_path", config_path, "is only read when resuming", "resume=true, or remove config_path")


def _validate_resume_and_output(cfg: TrainConfig) -> None:
    check_resume_request(cfg.resume, cfg.config_path)
    if not cfg.resume and cfg.output_dir is not None and Path(cfg.output_dir).exists():
        if any(Path(cfg.output_dir).iterdir()):
            raise config_error(
                "output_dir", cfg.output_dir,
                "already exists and is not empty; two runs must never share a run directory",
                "a new output_dir, or resume=true config_path=<output_dir>/checkpoints/last/pretrained_model/"
                "train_config.json",
            )


def check_sweep_point(output_dir: str | None, resume: bool) -> None:
    """A point of a Hydra multirun gets its own run directory, <sweep dir>/<job number>, and resumes it by itself."""
    if output_dir is not None:
        raise config_error(
            "output_dir", output_dir,
            "is set in a sweep (-m): every point would write into it; each point runs in <hydra.sweep.dir>/<job number>",
            "remove output_dir, and choose where the sweep goes with hydra.sweep.dir=<dir>",
        )
    if resume:
        raise config_error(
            "resume", True,
            "in a sweep (-m) every point would continue the same run; a sweep job resumes its own directory by itself",
            "resume one run at a time, without -m",
        )


def check_slurm_job(dp_replicate: int, dp_shard: int, nodes: int, tasks_per_node: int,
                    gpus_per_node: int | None) -> int:
    """The ranks of one SLURM job (``nodes x tasks_per_node``) against the parallel layout, before submission;
    returns the world size."""
    if nodes < 1:
        raise config_error("hydra.launcher.nodes", nodes, "must be >= 1", "hydra.launcher.nodes=1")
    if tasks_per_node < 1:
        raise config_error(
            "hydra.launcher.tasks_per_node", tasks_per_node,
            "must be >= 1: it is the number of ranks per node (it follows hydra.launcher.gpus_per_node, which is 0 "
            "on a CPU cluster)",
            "hydra.launcher.tasks_per_node=<ranks per node>",
        )
    if gpus_per_node and tasks_per_node != gpus_per_node:
        raise config_error(
            "hydra.launcher.tasks_per_node", tasks_per_node,
            f"must equal hydra.launcher.gpus_per_node={gpus_per_node}: one rank per GPU",
            f"hydra.launcher.tasks_per_node={gpus_per_node}",
        )
    world_size = nodes * tasks_per_node
    degrees_fixed = dp_shard != -1 and not (dp_replicate == 1 and dp_shard == 1)
    if degrees_fixed and dp_replicate >= 1 and dp_shard >= 1 and dp_replicate * dp_shard != world_size:
        wanted = dp_replicate * dp_shard
        fixes = []
        if wanted % tasks_per_node == 0:
            fixes.append(f"hydra.launcher.nodes={wanted // tasks_per_node}")
        if world_size % dp_replicate == 0:
            fixes.append(f"parallelism.dp_shard={world_size // dp_replicate}")
        raise config_error(
            "parallelism", {"dp_replicate": dp_replicate, "dp_shard": dp_shard},
            f"dp_replicate x dp_shard = {wanted} but the SLURM job has hydra.launcher.nodes x "
            f"hydra.launcher.tasks_per_node = {nodes} x {tasks_per_node} = {world_size} ranks",
            " or ".join(fixes) or f"hydra.launcher.nodes and hydra.launcher.tasks_per_node giving {wanted} ranks",
        )
    resolve_dp_degrees(dp_replicate, dp_shard, world_size)
    return world_size
