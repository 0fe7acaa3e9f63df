"""train(cfg): one run, read top to bottom. Every rank executes all of it; collectives are marked."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf

from lerobot_mg.accounting.ledger import BatchArithmetic, ResumeCause
from lerobot_mg.accounting.revision import code_revision
from lerobot_mg.checkpoint import layout
from lerobot_mg.checkpoint.manager import CheckpointManager, SaveItems, check_resumable
from lerobot_mg.checkpoint.state import write_json
from lerobot_mg.config.loading import DERIVED_KEY, train_config_to_dict
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.config.validate import config_error, validate
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.sampler import ResumableBatchSampler
from lerobot_mg.distributed.accelerator import (
    build_accelerator,
    launch_world,
    shard_units,
)
from lerobot_mg.distributed.env_guard import check_accelerate_env
from lerobot_mg.distributed.memory import gather_rank_bytes
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.launch.placement import record_placement
from lerobot_mg.launch.preemption import PreemptionWatch
from lerobot_mg.launch.run_dir import agree_on_output_dir
from lerobot_mg.launch.run_state import attach_run_log, releases_run_state
from lerobot_mg.launch.sweep import SweepJob
from lerobot_mg.optim import make_optimizer, make_scheduler
from lerobot_mg.peft.build import build_policy, describe_finetune, processors_dir
from lerobot_mg.peft.lora import AdapterWeights
from lerobot_mg.processors import PolicyProcessorPipeline, make_processors
from lerobot_mg.step import Stepper
from lerobot_mg.tracking import Progress, RunTracker

logger = logging.getLogger("lerobot_mg.train")


@releases_run_state  # a local sweep calls train() once per point in one process: each call cleans up after itself
def train(cfg: TrainConfig, composed: DictConfig | None = None, sweep_job: SweepJob | None = None) -> dict[str, Any]:
    check_accelerate_env()
    world_size, rank, local_rank = launch_world()
    validate(cfg, world_size)
    resume_dir = layout.checkpoint_dir_from_config_path(Path(cfg.config_path)) if cfg.resume else None
    resume_info = check_resumable(resume_dir) if resume_dir is not None else None
    if resume_info is not None and resume_info["step"] >= cfg.steps:
        raise config_error(
            "steps", cfg.steps, f"the checkpoint to resume is already at loop step {resume_info['step']}",
            f"steps=<more than {resume_info['step']}>",
        )
    dims = ParallelDims.resolve(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, world_size, rank, local_rank)

    set_seed(cfg.seed)  # identical initial weights on every rank (FSDP shards each rank's own copy)
    accelerator = build_accelerator(cfg.accelerator, dims)  # collective
    output_dir = (
        layout.run_dir_from_checkpoint(resume_dir)
        if resume_dir is not None
        else agree_on_output_dir(str(sweep_job.run_dir) if sweep_job else cfg.output_dir, cfg.job_name,
                                 dims.is_main_process, dims.is_distributed)
    )
    attach_run_log(output_dir, dims.is_main_process)
    record_placement(accelerator, dims, output_dir)  # collective
    preemption = PreemptionWatch(dims, accelerator.device, cfg.accelerator.gradient_accumulation.steps)
    arithmetic = BatchArithmetic(cfg.batch_size, dims.dp_world_size, cfg.accelerator.gradient_accumulation.steps)
    train_config = {**train_config_to_dict(cfg), "output_dir": str(output_dir), DERIVED_KEY: _derived(arithmetic, dims)}
    if dims.is_main_process:
        _save_run_configs(output_dir, train_config, composed, resumed=resume_dir is not None)

    dataset = LeRobotDataset(
        cfg.dataset.root, delta_timestamps=_action_deltas(cfg, cfg.dataset.root), episodes=cfg.dataset.episodes
    )
    sampler = ResumableBatchSampler(len(dataset), cfg.batch_size, cfg.seed, dims.rank, dims.dp_world_size)
    policy = build_policy(cfg, dataset.features)  # fresh, the base at policy.path, or that base under LoRA
    preprocessor, postprocessor = make_processors(cfg.policy, policy.input_features, policy.output_features, dataset.stats)
    if (saved := processors_dir(cfg, resume_dir)) is not None:  # normalisation as the resumed run / the base had it
        preprocessor = PolicyProcessorPipeline.from_pretrained(saved, "policy_preprocessor")
        postprocessor = PolicyProcessorPipeline.from_pretrained(saved, "policy_postprocessor")
    preprocessor = preprocessor.to(accelerator.device)
    if dims.is_sharded:  # the optimizer must see the sharded parameters of the wrap units
        shard_units(accelerator, policy, cfg.accelerator.fsdp)  # collective
    optimizer = make_optimizer(policy, cfg.optimizer)
    scheduler = make_scheduler(optimizer, cfg.scheduler, cfg.steps)
    model, optimizer = accelerator.prepare(policy, optimizer)  # collective: wraps the root (FSDP) or DDP
    checkpoints = CheckpointManager(output_dir, cfg.checkpoint.format, cfg.checkpoint.keep_last, dims,
                                    adapter=AdapterWeights.of(policy))
    finetune = {**describe_finetune(cfg, policy), "rank_bytes": gather_rank_bytes(policy)}  # collective

    run_facts = _run_facts(cfg, dataset)  # git + dataset hashing: once per start
    progress, continuation = Progress(), None
    if resume_dir is not None:
        info = checkpoints.load(resume_dir, model, optimizer, scheduler, accelerator.scaler)  # collective
        progress = Progress(**info["progress"])
        continuation = sampler.load_state_dict(info["sampler"])
        _apply_optimizer_config(optimizer, scheduler, cfg)
        # Checkpoints only ever sit on accumulation boundaries (validated), so the resumed run starts a fresh
        # window, as accelerate's step counter already does.
        if dims.is_main_process:
            _warn_resume_differences(resume_info, cfg, dims, run_facts, continuation)
    else:
        set_seed(cfg.seed + dims.rank)  # per-rank noise (dropout, VAE sampling) after identical initial weights

    tracker = RunTracker(cfg, dims, arithmetic, sampler, output_dir, train_config, progress, accelerator.device)
    resume_cause = (sweep_job.resume_cause if sweep_job else ResumeCause.REQUESTED) if resume_dir else None
    tracker.record_start(resume_dir, run_facts, continuation, finetune, resume_cause)
    _print_banner(cfg, dims, arithmetic, finetune, dataset, output_dir, progress, continuation)
    stepper = Stepper(accelerator, model, optimizer, scheduler, preprocessor, cfg, dims)
    batches = _batches(dataset, sampler, cfg.num_workers, pin_memory=accelerator.device.type == "cuda")
    save_items = SaveItems(policy, preprocessor, postprocessor, scheduler, accelerator.scaler, train_config, {})

    while progress.step < cfg.steps:
        epoch, offset = sampler.epoch, sampler.offset
        batch = next(batches)
        sampler.advance()
        tracker.step_done(stepper.step(batch), epoch, offset)  # collective on log steps
        preempted = progress.step < cfg.steps and preemption.agreed(progress.step)  # collective
        if cfg.checkpoint.save_checkpoint and (
            preempted or progress.step % cfg.checkpoint.save_freq == 0 or progress.step == cfg.steps
        ):
            save_items.training_step = _training_step_record(progress, sampler, cfg, dims, arithmetic, run_facts)
            checkpoints.save(progress.step, model, optimizer, save_items)  # collective
        if preempted:
            tracker.close()
            preemption.requeue(output_dir, progress.step)  # does not return; the requeued job resumes from here

    rank_bytes = gather_rank_bytes(policy, optimizer)  # collective: what each rank held for training
    tracker.close()
    result = {"output_dir": str(output_dir), "progress": progress.__dict__.copy(),
              "final_loss": tracker.last_metrics["loss"], "rank_bytes": rank_bytes}
    if dims.is_main_process:
        write_json(output_dir / "rank_bytes.json", rank_bytes)
    accelerator.wait_for_everyone()
    if cfg.eval.n_episodes > 0 and dims.is_main_process:  # after the last collective: other ranks may exit
        result["eval"] = _evaluate(output_dir, cfg)
    accelerator.end_training()
    return result


# --- the pieces train() calls ------------------------------------------------------------------------------


def _action_deltas(cfg: TrainConfig, root: str) -> dict[str, list[float]]:
    """Action chunks of ``policy.chunk_size`` frames from the current one on."""
    import json

    fps = json.loads((Path(root) / "meta" / "info.json").read_text())["fps"]
    return {"action": [i / fps for i in range(cfg.policy.chunk_size)]}


def _batches(dataset: LeRobotDataset, sampler: ResumableBatchSampler, num_workers: int, pin_memory: bool):
    """Endless batches; one DataLoader pass per epoch, starting at the sampler's saved position.

    Each pass gets its own generator: a DataLoader otherwise draws its worker seed from the global RNG when
    its iterator starts, and a resumed run (which starts an iterator mid-epoch) would drift from a straight one.
    """
    while True:
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=num_workers, persistent_workers=False,
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(sampler.seed * 100_003 + sampler.epoch),
        )
        yield from loader


def _apply_optimizer_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR | None,
                            cfg: TrainConfig) -> None:
    """After loading the optimizer state: hyper-parameters come from this run's config, so an override on the
    resume command line (e.g. optimizer.lr) takes effect. Unchanged values give the same numbers as before."""
    opt = cfg.optimizer
    for group in optimizer.param_groups:
        group.update(initial_lr=opt.lr, betas=(opt.betas[0], opt.betas[1]), eps=opt.eps, weight_decay=opt.weight_decay)
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = opt.lr
        return
    scheduler.base_lrs = [opt.lr] * len(optimizer.param_groups)
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)


def _derived(arithmetic: BatchArithmetic, dims: ParallelDims) -> dict[str, Any]:
    return {**arithmetic.as_dict(), "banner": arithmetic.banner(), "topology": dims.to_dict()}


def _save_run_configs(output_dir: Path, train_config: dict, composed: DictConfig | None, resumed: bool) -> None:
    """The composed (with interpolations) and the resolved config, once per run (a resume keeps the originals;
    each checkpoint carries the config it was saved under)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if resumed and (output_dir / layout.TRAIN_CONFIG_JSON).exists():
        return
    write_json(output_dir / layout.TRAIN_CONFIG_JSON, train_config)
    if composed is not None:
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(composed, resolve=False))


def _run_facts(cfg: TrainConfig, dataset: LeRobotDataset) -> dict:
    return {"code_revision": code_revision(), "dataset_fingerprint": dataset.fingerprint(), "dataset_root": cfg.dataset.root}


def _training_step_record(progress: Progress, sampler: ResumableBatchSampler, cfg: TrainConfig, dims: ParallelDims,
                          arithmetic: BatchArithmetic, run_facts: dict) -> dict[str, Any]:
    return {
        "step": progress.step,
        "dp_world_size": dims.dp_world_size,
        "batch_size": cfg.batch_size,
        "gradient_accumulation_steps": cfg.accelerator.gradient_accumulation.steps,
        "effective_batch_size": arithmetic.effective_batch_size,
        "mixed_precision": cfg.accelerator.mixed_precision,
        "topology": dims.to_dict(),
        "world_size": dims.world_size,
        "checkpoint_format": cfg.checkpoint.format,
        "progress": progress.__dict__.copy(),
        "sampler": sampler.state_dict(),
        **run_facts,
    }


def _warn_resume_differences(saved: dict, cfg: TrainConfig, dims: ParallelDims, run_facts: dict,
                             continuation: str) -> None:
    # Anything but a sample-exact continuation changes the training stream: say so loudly.
    (logger.info if "sample-exact" in continuation.split(":")[0] else logger.warning)(continuation)
    if saved["topology"] != dims.to_dict():
        logger.warning("Resuming on a new topology: %s -> %s (model and optimizer state resharded).",
                       saved["topology"], dims.to_dict())
    if saved.get("dataset_fingerprint") != run_facts["dataset_fingerprint"]:
        logger.warning("The dataset differs from the checkpoint's (fingerprint %s -> %s): the sample stream is not "
                       "the original one.", saved.get("dataset_fingerprint"), run_facts["dataset_fingerprint"])
    if saved.get("code_revision") != run_facts["code_revision"]:
        logger.warning("The code revision changed since the checkpoint: %s -> %s.", saved.get("code_revision"),
                       run_facts["code_revision"])
    if saved["gradient_accumulation_steps"] != cfg.accelerator.gradient_accumulation.steps:
        logger.warning("gradient accumulation changed at resume: %s -> %s steps per optimizer update.",
                       saved["gradient_accumulation_steps"], cfg.accelerator.gradient_accumulation.steps)


def _print_banner(cfg: TrainConfig, dims: ParallelDims, arithmetic: BatchArithmetic, finetune: dict[str, Any],
                  dataset: LeRobotDataset, output_dir: Path, progress: Progress, continuation: str | None) -> None:
    if not dims.is_main_process:
        return
    num_params, num_trainable = finetune["total_params"], finetune["trainable_params"]
    per_rank = ", ".join(f"{held['parameters'] / 2**20:.2f}" for held in finetune["rank_bytes"])
    lines = [
        f"lerobot_mg train: {cfg.job_name} -> {output_dir}",
        f"  topology: {dims.describe()} (world size {dims.world_size})",
        f"  batch: {arithmetic.banner()}",
        f"  steps: {cfg.steps} loop steps = {arithmetic.sample_presentations(cfg.steps)} sample presentations, "
        f"{arithmetic.optimizer_updates(cfg.steps)} optimizer updates (lr and steps are never auto-scaled)",
        f"  precision: {cfg.accelerator.mixed_precision}  checkpoint format: {cfg.checkpoint.format}",
        f"  policy: {cfg.policy.type} ({num_params:,} params, {num_trainable:,} trainable = "
        f"{100 * num_trainable / num_params:.1f}%)  dataset: {dataset.root} "
        f"({len(dataset)} frames, {dataset.num_episodes} episodes)",
        f"  parameter MiB per rank: [{per_rank}]",
    ]
    if finetune["base_model_path"] is not None:
        peft = finetune["peft"]
        how = (f"{peft['method_type']} r={peft['r']} lora_alpha={peft['lora_alpha']:g} on {peft['target_modules']}"
               f", full training {peft['full_training_modules']}" if peft else "full fine-tuning")
        lines.append(f"  base model: {finetune['base_model_path']} ({how})")
    if progress.step:
        lines.append(f"  resumed at loop step {progress.step}: {continuation}")
    print("\n".join(lines), flush=True)


def _evaluate(output_dir: Path, cfg: TrainConfig) -> dict[str, Any]:
    """Roll out the last checkpoint in simulation (needs the `sim` extra); main process only."""
    from lerobot_mg.sim.evaluate import evaluate_policy

    pretrained = layout.checkpoints_root(output_dir) / layout.LAST_LINK / layout.PRETRAINED_MODEL_DIR
    video_dir = output_dir / "eval" / "videos" if cfg.eval.n_video_episodes > 0 else None
    result = evaluate_policy(pretrained, n_episodes=cfg.eval.n_episodes, seed_start=cfg.eval.seed_start,
                             video_dir=video_dir, n_video_episodes=cfg.eval.n_video_episodes,
                             device="cuda" if torch.cuda.is_available() and not cfg.accelerator.cpu else "cpu")
    write_json(output_dir / "eval_info.json", result)
    print(f"eval: success rate {result['success_rate']:.2f} ({result['num_successes']}/{result['n_episodes']}), "
          f"mean return {result['mean_return']:.1f}; checkpoint: {pretrained}", flush=True)
    return result
