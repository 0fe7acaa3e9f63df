"""train(cfg): one run, read top to bottom. Every rank executes all of it; collectives are marked."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from omegaconf import DictConfig

from lerobot_mg.checkpoint.manager import CheckpointManager, SaveItems
from lerobot_mg.checkpoint.resume import training_step
from lerobot_mg.checkpoint.state import write_json
from lerobot_mg.config.loading import DERIVED_KEY, train_config_to_dict
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.data.loader import endless_batches
from lerobot_mg.data.mixture import MixtureDataset, MixtureSampler
from lerobot_mg.data.sampler import ResumableBatchSampler
from lerobot_mg.distributed.accelerator import (
    build_accelerator,
    launch_world,
    launched,
    prepare,
    prepare_units,
)
from lerobot_mg.distributed.memory import MemoryPlan, gather_rank_bytes
from lerobot_mg.drills import stepper_type
from lerobot_mg.evaluation import Evaluator
from lerobot_mg.launch.hub import publish_policy
from lerobot_mg.launch.placement import record_placement
from lerobot_mg.launch.preemption import PreemptionWatch, resume_command
from lerobot_mg.launch.run_dir import run_dir, save_run_configs
from lerobot_mg.launch.run_state import attach_run_log, releases_run_state
from lerobot_mg.launch.sweep import SweepJob
from lerobot_mg.optim import apply_optimizer_config, describe_schedule, make_optimizer, make_scheduler
from lerobot_mg.peft.build import build_policy, describe_finetune, processors_dir
from lerobot_mg.peft.lora import AdapterWeights
from lerobot_mg.preflight import preflight
from lerobot_mg.processors import camera_keys, processors_for
from lerobot_mg.processors.language import worker_language
from lerobot_mg.processors.mixture import normalise_sources
from lerobot_mg.run_facts import Progress, ResumeCause, RunFacts
from lerobot_mg.step import make_ema
from lerobot_mg.tracking import RunTracker, device_facts, log_resume, print_banner


@dataclass(frozen=True)
class TrainResult:
    """What a run returns (a sweep's job return value). ``plan=true`` returns the memory plan alone."""

    memory_plan: MemoryPlan
    output_dir: Path | None = None
    progress: Progress | None = None
    final_loss: float | None = None
    rank_bytes: list[dict[str, Any]] | None = None  # what each rank held for training, in rank order
    eval: dict[str, Any] | None = None  # the last evaluation (eval_info.json: simulation, validation loss)


@releases_run_state  # a local sweep calls train() once per point in one process: each call cleans up after itself
def train(cfg: TrainConfig, composed: DictConfig | None = None, sweep_job: SweepJob | None = None) -> TrainResult:
    checked = preflight(cfg, *launch_world(), launched=launched())  # every start-up check, before any process group
    dims, resume, meta = checked.dims, checked.resume, checked.dataset
    if cfg.torch_threads is not None:  # before any model exists; evaluation runs under it too
        torch.set_num_threads(cfg.torch_threads)
    if cfg.plan:
        if dims.is_main_process:
            print("\n".join(checked.memory.describe()), flush=True)
        return TrainResult(checked.memory)

    set_seed(cfg.seed)  # identical initial weights on every rank (FSDP shards each rank's own copy)
    accelerator = build_accelerator(cfg.accelerator, dims)  # collective
    output_dir = run_dir(cfg, resume, sweep_job, dims)  # collective
    attach_run_log(output_dir, dims.is_main_process)
    record_placement(accelerator, dims, output_dir)  # collective
    group_timeout = timedelta(seconds=cfg.accelerator.process_group_timeout_s)
    # Ctrl-C, SIGTERM and SLURM preemption: every rank saves at the same step, then the run stops or is requeued.
    preemption = PreemptionWatch(dims, cfg.accelerator.gradient_accumulation.steps, group_timeout)  # collective

    policy = build_policy(cfg, meta.features)  # fresh, the base at policy.path, or that base under LoRA
    # Only what the policy reads is decoded (and checked at start-up): cameras it does not use may be missing.
    dataset = checked.train_data  # opened by the preflight, which built its dataset cache before any process group
    assert dataset is not None
    mixture = dataset if isinstance(dataset, MixtureDataset) else None
    sampler = (MixtureSampler(mixture, cfg.batch_size, cfg.seed, dims.rank, dims.dp_world_size) if mixture else
               ResumableBatchSampler(len(dataset), cfg.batch_size, cfg.seed, dims.rank, dims.dp_world_size,
                                     cache_dir=dataset.cache_dir))
    saved_processors = processors_dir(cfg, None if resume is None else resume.step_dir)  # the resumed run's or base's
    preprocessor, postprocessor = processors_for(cfg.policy, policy, dataset.stats, saved_processors,
                                                 camera_keys(meta.features) if cfg.dataset.use_imagenet_stats else (),
                                                 saved_stats=resume is not None or cfg.dataset.use_base_stats)
    # A mixture: each source's map into the normaliser's statistics (dataset.stats), and per source its own files.
    source_processors = normalise_sources(mixture, preprocessor, postprocessor, cfg.dataset.stats) if mixture else {}
    preprocessor = preprocessor.to(accelerator.device)
    # Before the optimizer exists: it must see the sharded parameters of the wrap units.
    prepare_units(accelerator, policy, cfg.accelerator, dims)  # collective: checkpointing, compile, sharding
    optimizer = make_optimizer(policy, cfg.optimizer)
    scheduler = make_scheduler(optimizer, cfg.scheduler, cfg.steps)
    model, optimizer = prepare(accelerator, policy, optimizer, dims)  # collective: wraps the root (FSDP) or DDP
    ema = make_ema(policy, cfg.ema)  # ema.enable: after sharding, so each rank averages its own shards
    checkpoints = CheckpointManager(output_dir, cfg.checkpoint.format, cfg.checkpoint.keep_last, dims,
                                    adapter=AdapterWeights.of(policy), async_save=cfg.checkpoint.async_save,
                                    group_timeout=group_timeout, ema=ema,  # collective when async_save
                                    keep_best=cfg.checkpoint.keep_best, best_metric=cfg.best_metric())
    facts = RunFacts.collect(  # once per start
        cfg, dims, dataset_fingerprint=dataset.fingerprint(), model=describe_finetune(cfg, policy),
        lr_schedule=describe_schedule(cfg.optimizer, cfg.scheduler, cfg.steps),
        rank_bytes=gather_rank_bytes(policy),  # collective: every rank's parameter bytes
        resumed=None if resume is None else (resume.step_dir, resume.facts),
        resume_cause=sweep_job.resume_cause if sweep_job is not None else ResumeCause.REQUESTED,
        dataset_source=None if checked.dataset_source is None else asdict(checked.dataset_source),
        mixture=mixture and mixture.facts(), flops_per_sample=checked.flops_per_sample,
        device=device_facts(accelerator.device, cfg.accelerator.mixed_precision, policy))
    train_config = {**train_config_to_dict(cfg), "output_dir": str(output_dir), DERIVED_KEY: asdict(facts)}
    if dims.is_main_process:
        save_run_configs(output_dir, train_config, composed, resumed=resume is not None)

    progress = Progress()
    if resume is not None:
        checkpoints.load(resume.step_dir, model, optimizer, scheduler, accelerator.scaler)  # collective
        progress = replace(resume.progress)  # a copy: the loop advances it
        position = sampler.load_state_dict(resume.sampler_state)
        apply_optimizer_config(optimizer, scheduler, cfg.optimizer)  # e.g. a new optimizer.lr on the command line
        if dims.is_main_process:
            log_resume(resume, facts, position)
    else:
        set_seed(cfg.seed + dims.rank)  # per-rank noise (dropout, VAE sampling) after identical initial weights

    tracker = RunTracker(cfg.logging, cfg.log_freq, cfg.steps, facts, progress, dims, output_dir, accelerator.device,
                         train_config, cfg.trackio)  # writes the start/resume record
    if dims.is_main_process:
        print_banner(cfg, facts, dataset, output_dir, progress)
    # The plain Stepper; the one that runs a fault drill only on the rank LEROBOT_MG_FAULT names (lerobot_mg.drills).
    stepper = stepper_type(dims.rank)(accelerator, model, optimizer, scheduler, preprocessor,
                                      cfg.optimizer.grad_clip_norm, dims, uint8_keys=dataset.visual_keys, ema=ema)
    batches = endless_batches(dataset, sampler, cfg.num_workers, pin_memory=accelerator.device.type == "cuda",
                              prepare=worker_language(preprocessor))  # a VLA's prompts tokenised in the workers
    save_items = SaveItems(policy, preprocessor, postprocessor, scheduler, accelerator.scaler, train_config,
                           source_processors)
    evaluator = Evaluator(cfg, dims, accelerator.device, policy, (preprocessor, postprocessor), meta,
                          checked.split.val, output_dir, record=tracker.evaluated, ema=ema)

    while progress.step < cfg.steps:
        waited_from = time.perf_counter()
        batch = next(batches)
        data_wait_s = time.perf_counter() - waited_from  # the ledger's dataloading_s (a host wait: no device sync)
        if mixture is not None and dims.is_main_process:  # what the global batch drew, per source, for the ledger
            tracker.drawn(*mixture.locate(sampler.global_window()))
        sampler.advance()
        tracker.step_done(stepper.step(batch), batch["index"], data_wait_s)  # collective on log steps
        checkpoints.poll()  # a background save whose files are all written becomes `last`
        stop = progress.step < cfg.steps and preemption.agreed(progress.step)  # collective
        evaluated = evaluator.after_step(progress, stopping=stop)  # collective on evaluation steps
        if saving := cfg.checkpoint.is_save_step(progress.step, cfg.steps, stop, evaluated is not None):
            tracker.checkpoint()  # collective: the ledger is on disk up to every checkpoint
            # A stopping run's save must be on disk before it exits or requeues.
            checkpoints.save(progress.step, model, optimizer, save_items,  # collective
                             training_step(progress, sampler.state_dict(), facts), blocking=stop, evaluation=evaluated)
        if stop:
            tracker.close()
            checkpoints.close()
            preemption.leave(output_dir, progress, saving,  # does not return: exits 128 + signal, or requeues
                             resume_command(output_dir, progress.step, sweep_job and sweep_job.run_dir.parent))

    preemption.finish()
    checkpoints.close()  # the last save is on disk and `last` names it before the run reports
    rank_bytes = gather_rank_bytes(policy, optimizer, ema)  # collective: what each rank held for training
    tracker.close()
    if dims.is_main_process:
        write_json(output_dir / "rank_bytes.json", rank_bytes)
    accelerator.wait_for_everyone()
    if cfg.policy.publishes and dims.is_main_process:  # policy.repo_id: the complete last checkpoint, with a card
        publish_policy(cfg, output_dir, facts, progress, tracker.last_metrics["loss"], evaluator.final)
    return TrainResult(checked.memory, output_dir, progress, tracker.last_metrics["loss"], rank_bytes, evaluator.final)
