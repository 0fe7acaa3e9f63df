"""train(cfg): one run, read top to bottom. Every rank executes all of it; collectives are marked."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf

from lerobot_mg.checkpoint import layout
from lerobot_mg.checkpoint.manager import CheckpointManager, SaveItems
from lerobot_mg.checkpoint.resume import ResumePoint, resume_point, training_step
from lerobot_mg.checkpoint.state import write_json
from lerobot_mg.config.loading import DERIVED_KEY, train_config_to_dict
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.config.validate import validate
from lerobot_mg.data.lerobot_dataset import LeRobotDataset, read_info
from lerobot_mg.data.loader import one_pass
from lerobot_mg.data.sampler import ResumableBatchSampler, sample_seeds
from lerobot_mg.distributed.accelerator import build_accelerator, launch_world, prepare_units
from lerobot_mg.distributed.env_guard import check_accelerate_env
from lerobot_mg.distributed.memory import check_fits, gather_rank_bytes, memory_budget, plan_memory
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Continuation, ParallelDims
from lerobot_mg.drills import fault_drill
from lerobot_mg.launch.placement import record_placement
from lerobot_mg.launch.preemption import PreemptionWatch
from lerobot_mg.launch.run_dir import agree_on_output_dir
from lerobot_mg.launch.run_state import attach_run_log, releases_run_state
from lerobot_mg.launch.sweep import SweepJob
from lerobot_mg.optim import apply_optimizer_config, describe_schedule, make_optimizer, make_scheduler
from lerobot_mg.peft.build import build_policy, describe_finetune, processors_dir
from lerobot_mg.peft.lora import AdapterWeights
from lerobot_mg.policies.base import SAMPLE_SEED_KEY, delta_timestamps
from lerobot_mg.processors import PolicyProcessorPipeline, make_processors
from lerobot_mg.run_facts import CodeRevision, Progress, ResumeCause, RunFacts
from lerobot_mg.step import Stepper
from lerobot_mg.tracking import RunTracker

logger = logging.getLogger("lerobot_mg.train")


@releases_run_state  # a local sweep calls train() once per point in one process: each call cleans up after itself
def train(cfg: TrainConfig, composed: DictConfig | None = None, sweep_job: SweepJob | None = None) -> dict[str, Any]:
    check_accelerate_env()
    world_size, rank, local_rank = launch_world()
    validate(cfg, world_size)
    if cfg.torch_threads is not None:  # before any model exists; the sim evaluation at the end runs under it too
        torch.set_num_threads(cfg.torch_threads)
    # Before any process group: an unusable checkpoint stops the run here.
    resume = resume_point(cfg.config_path, cfg.steps) if cfg.resume else None
    dims = ParallelDims.resolve(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, world_size, rank, local_rank)
    info = read_info(Path(cfg.dataset.root))  # the features a policy is built on and the fps of its sample offsets
    memory = plan_memory(cfg, dims, info["features"])  # from a meta-device policy: no memory, no process group
    if cfg.plan:
        if dims.is_main_process:
            print("\n".join(memory.describe()), flush=True)
        return {"memory_plan": memory}
    check_fits(memory, memory_budget(memory.on_device, dims.local_rank))  # refuse a run that cannot fit

    set_seed(cfg.seed)  # identical initial weights on every rank (FSDP shards each rank's own copy)
    accelerator = build_accelerator(cfg.accelerator, dims)  # collective
    output_dir = _output_dir(cfg, resume, sweep_job, dims)  # collective
    attach_run_log(output_dir, dims.is_main_process)
    record_placement(accelerator, dims, output_dir)  # collective
    preemption = PreemptionWatch(dims, accelerator.device, cfg.accelerator.gradient_accumulation.steps)

    policy = build_policy(cfg, info["features"])  # fresh, the base at policy.path, or that base under LoRA
    # Only what the policy reads is decoded (and checked at start-up): cameras it does not use may be missing.
    dataset = LeRobotDataset(cfg.dataset.root, delta_timestamps(cfg.policy, info["features"], info["fps"]),
                             cfg.dataset.episodes, keys=[*policy.input_features, *policy.output_features],
                             uint8_visuals=True)
    sampler = ResumableBatchSampler(len(dataset), cfg.batch_size, cfg.seed, dims.rank, dims.dp_world_size)
    preprocessor, postprocessor = _processors(cfg, policy, dataset, resume)
    preprocessor = preprocessor.to(accelerator.device)
    # Before the optimizer exists: it must see the sharded parameters of the wrap units.
    prepare_units(accelerator, policy, cfg.accelerator, dims)  # collective: checkpointing, compile, sharding
    optimizer = make_optimizer(policy, cfg.optimizer)
    scheduler = make_scheduler(optimizer, cfg.scheduler, cfg.steps)
    model, optimizer = accelerator.prepare(policy, optimizer)  # collective: wraps the root (FSDP) or DDP
    checkpoints = CheckpointManager(output_dir, cfg.checkpoint.format, cfg.checkpoint.keep_last, dims,
                                    adapter=AdapterWeights.of(policy),
                                    async_save=cfg.checkpoint.async_save,  # collective when async_save
                                    group_timeout=timedelta(seconds=cfg.accelerator.process_group_timeout_s))
    facts = _run_facts(cfg, dims, dataset, policy, resume, sweep_job)  # collective (bytes per rank); once per start
    train_config = {**train_config_to_dict(cfg), "output_dir": str(output_dir), DERIVED_KEY: asdict(facts)}
    if dims.is_main_process:
        _save_run_configs(output_dir, train_config, composed, resumed=resume is not None)

    progress = Progress()
    if resume is not None:
        checkpoints.load(resume.step_dir, model, optimizer, scheduler, accelerator.scaler)  # collective
        progress = replace(resume.progress)  # a copy: the loop advances it
        position = sampler.load_state_dict(resume.sampler_state)
        apply_optimizer_config(optimizer, scheduler, cfg.optimizer)  # e.g. a new optimizer.lr on the command line
        if dims.is_main_process:
            _log_resume(resume, facts, position)
    else:
        set_seed(cfg.seed + dims.rank)  # per-rank noise (dropout, VAE sampling) after identical initial weights

    tracker = RunTracker(cfg.logging, cfg.log_freq, cfg.steps, facts, progress, dims, output_dir, accelerator.device,
                         train_config)  # writes the start/resume record
    if dims.is_main_process:
        _print_banner(cfg, facts, dataset, output_dir, progress)
    stepper = Stepper(accelerator, model, optimizer, scheduler, preprocessor, cfg.optimizer.grad_clip_norm, dims,
                      uint8_keys=dataset.visual_keys, after_backward=fault_drill(dims.rank))
    batches = _batches(dataset, sampler, cfg.num_workers, pin_memory=accelerator.device.type == "cuda")
    save_items = SaveItems(policy, preprocessor, postprocessor, scheduler, accelerator.scaler, train_config)

    while progress.step < cfg.steps:
        waited_from = time.perf_counter()
        batch = next(batches)
        data_wait_s = time.perf_counter() - waited_from
        sampler.advance()
        tracker.step_done(stepper.step(batch), batch["index"], data_wait_s)  # collective on log steps
        checkpoints.poll()  # a background save whose files are all written becomes `last`
        preempted = progress.step < cfg.steps and preemption.agreed(progress.step)  # collective
        if _is_save_step(cfg, progress.step, preempted):
            tracker.checkpoint()  # collective: the ledger is on disk up to every checkpoint
            # A preempted job's save must be on disk before it requeues.
            checkpoints.save(progress.step, model, optimizer, save_items,  # collective
                             training_step(progress, sampler.state_dict(), facts), blocking=preempted)
        if preempted:
            tracker.close()
            preemption.requeue(output_dir, progress.step)  # does not return; the requeued job resumes from here

    checkpoints.close()  # the last save is on disk and `last` names it before the run reports
    rank_bytes = gather_rank_bytes(policy, optimizer)  # collective: what each rank held for training
    tracker.close()
    result = {"output_dir": str(output_dir), "progress": asdict(progress), "final_loss": tracker.last_metrics["loss"],
              "rank_bytes": rank_bytes}
    if dims.is_main_process:
        write_json(output_dir / "rank_bytes.json", rank_bytes)
    accelerator.wait_for_everyone()
    if cfg.eval.n_episodes > 0 and dims.is_main_process:  # after the last collective: other ranks may exit
        result["eval"] = _evaluate(output_dir, cfg)
    accelerator.end_training()
    return result


# --- the pieces train() calls ------------------------------------------------------------------------------


def _output_dir(cfg: TrainConfig, resume: ResumePoint | None, sweep_job: SweepJob | None, dims: ParallelDims) -> Path:
    """The resumed run's directory, the sweep job's, output_dir, or a new one named by the main process.
    Collective when distributed and none is given."""
    if resume is not None:
        return layout.run_dir_from_checkpoint(resume.step_dir)
    requested = str(sweep_job.run_dir) if sweep_job is not None else cfg.output_dir
    return agree_on_output_dir(requested, cfg.job_name, dims.is_main_process, dims.is_distributed)


def _run_facts(cfg: TrainConfig, dims: ParallelDims, dataset: LeRobotDataset, policy: torch.nn.Module,
               resume: ResumePoint | None, sweep_job: SweepJob | None) -> RunFacts:
    """Collective (every rank's parameter bytes); git and the dataset hashing run once per start."""
    batch = BatchArithmetic(cfg.batch_size, dims.dp_world_size, cfg.accelerator.gradient_accumulation.steps)
    resume_cause = sweep_job.resume_cause if sweep_job is not None else ResumeCause.REQUESTED
    return RunFacts(
        batch=batch, topology=dims.topology, precision=cfg.accelerator.mixed_precision,
        checkpoint_format=cfg.checkpoint.format, code_revision=CodeRevision.of_checkout(),
        dataset_fingerprint=dataset.fingerprint(),
        lr_schedule=describe_schedule(cfg.optimizer, cfg.scheduler, cfg.steps),
        model=describe_finetune(cfg, policy), rank_bytes=tuple(gather_rank_bytes(policy)),
        resumed_from=None if resume is None else str(resume.step_dir),
        continuation=None if resume is None else Continuation.of_resume(resume.facts.batch, batch),
        resume_cause=None if resume is None else resume_cause,
    )


def _is_save_step(cfg: TrainConfig, step: int, preempted: bool) -> bool:
    """Every save_freq loop steps, at the last one and on preemption (all on optimizer-update boundaries)."""
    return cfg.checkpoint.save_checkpoint and (preempted or step % cfg.checkpoint.save_freq == 0 or step == cfg.steps)


def _processors(cfg: TrainConfig, policy: torch.nn.Module, dataset: LeRobotDataset,
                resume: ResumePoint | None) -> tuple[PolicyProcessorPipeline, PolicyProcessorPipeline]:
    saved = processors_dir(cfg, None if resume is None else resume.step_dir)  # the resumed run's, or the base's
    if saved is None:
        return make_processors(cfg.policy, policy.input_features, policy.output_features, dataset.stats)
    return (PolicyProcessorPipeline.from_pretrained(saved, "policy_preprocessor"),
            PolicyProcessorPipeline.from_pretrained(saved, "policy_postprocessor"))


def _batches(dataset: LeRobotDataset, sampler: ResumableBatchSampler, num_workers: int, pin_memory: bool):
    """Endless batches, each with its samples' seeds; one DataLoader pass per epoch, starting at the sampler's
    saved position.

    One DataLoader for the whole run: its workers persist from one epoch to the next, with their open video files
    (a new pass otherwise forks new workers, which reopen every file and leave the loop waiting at each epoch's
    start). It has a generator of its own: a DataLoader otherwise draws its worker seed from the global RNG when an
    iterator starts, and a resumed run (which starts one mid-epoch) would drift from a straight one.
    """
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, persistent_workers=num_workers > 0,
        pin_memory=pin_memory, generator=torch.Generator().manual_seed(sampler.seed * 100_003 + sampler.epoch),
    )
    while True:
        epoch = sampler.epoch  # the sampler reads its position when the pass starts, as here
        for batch in one_pass(loader):  # a worker that dies is named in the error
            yield {**batch, SAMPLE_SEED_KEY: sample_seeds(sampler.seed, epoch, batch["index"])}


def _save_run_configs(output_dir: Path, train_config: dict, composed: DictConfig | None, resumed: bool) -> None:
    """The composed (with interpolations) and the resolved config, once per run (a resume keeps the originals;
    each checkpoint carries the config it was saved under)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if resumed and (output_dir / layout.TRAIN_CONFIG_JSON).exists():
        return
    write_json(output_dir / layout.TRAIN_CONFIG_JSON, train_config)
    if composed is not None:
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(composed, resolve=False))


def _log_resume(resume: ResumePoint, facts: RunFacts, position: str) -> None:
    """How exactly the sample stream continues, and every fact that changed since the checkpoint's start."""
    continuation = facts.continuation or Continuation.SAMPLE_EXACT
    # Anything but a sample-exact continuation changes what each rank trains on: say so loudly.
    level = logging.INFO if continuation is Continuation.SAMPLE_EXACT else logging.WARNING
    logger.log(level, "Data sampler resumed %s at %s: %s.", continuation.value, position, continuation.describe())
    for change in facts.changes_since(resume.facts):
        logger.warning("%s.", change.describe(f"at resume (step {resume.progress.step})"))


def _print_banner(cfg: TrainConfig, facts: RunFacts, dataset: LeRobotDataset, output_dir: Path,
                  progress: Progress) -> None:
    num_params, num_trainable = facts.model["total_params"], facts.model["trainable_params"]
    per_rank = ", ".join(f"{held['parameters'] / 2**20:.2f}" for held in facts.rank_bytes)
    lines = [f"lerobot_mg train: {cfg.job_name} -> {output_dir}", *(f"  {line}" for line in facts.describe()),
             f"  steps: {cfg.steps} loop steps = {facts.batch.sample_presentations(cfg.steps)} sample presentations, "
             f"{facts.batch.optimizer_updates(cfg.steps)} optimizer updates (lr and steps are never auto-scaled)",
             f"  policy: {cfg.policy.type} ({num_params:,} params, {num_trainable:,} trainable = "
             f"{100 * num_trainable / num_params:.1f}%)  dataset: {dataset.root} ({len(dataset)} frames, "
             f"{dataset.num_episodes} episodes)",
             f"  parameter MiB per rank: [{per_rank}]"]
    if facts.model["base_model_path"] is not None:
        peft = facts.model["peft"]
        how = (f"{peft['method_type']} r={peft['r']} lora_alpha={peft['lora_alpha']:g} on {peft['target_modules']}"
               f", full training {peft['full_training_modules']}" if peft else "full fine-tuning")
        lines.append(f"  base model: {facts.model['base_model_path']} ({how})")
    if facts.continuation is not None and facts.resume_cause is not None:
        lines.append(f"  resumed at loop step {progress.step} from {facts.resumed_from} ({facts.resume_cause.value}): "
                     f"{facts.continuation.value}")
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
