"""Everything a start checks before any process group exists, once, in one place.

:func:`preflight` runs on every rank at the top of ``train()`` (and for each point of a SLURM sweep before anything
is queued): the launch environment, the config's fields against each other and the layout, this machine's device,
the base at ``policy.path`` and the ``peft.*`` group, the dataset's metadata against the policy and the batch, the
checkpoint to resume, the policy built once on the meta device, the memory plan of the layout, and the training
dataset opened with its dataset cache built (a long first build never runs inside a collective's timeout). Each
refusal is a ``ConfigError`` in the one style (``key=value: problem. Fix: override``); what the checks read (the
dataset's metadata and the opened dataset, the resume point, the plan) is returned for ``train()`` to reuse, so no
file is read twice.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from lerobot_mg.accounting.throughput import training_flops_per_sample
from lerobot_mg.checkpoint.resume import ResumePoint, resume_point
from lerobot_mg.config.choices import DatasetName, MixtureStats
from lerobot_mg.config.loading import check_resume_request
from lerobot_mg.config.schema import DatasetConfig, TrainConfig
from lerobot_mg.config.validate import validate
from lerobot_mg.data import cache
from lerobot_mg.data.hub import DatasetSource, hub_write_refusal, resolve_dataset
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.meta import DATASET_SCOPE, DatasetMeta, dataset_name
from lerobot_mg.data.mixture import MixtureDataset, MixturePlan, plan_mixture
from lerobot_mg.data.split import EpisodeSplit, split_episodes
from lerobot_mg.distributed.device import compile_unavailable_reason, precision_unsupported, use_cpu
from lerobot_mg.distributed.env_guard import check_accelerate_env
from lerobot_mg.distributed.memory import (
    MemoryBudget,
    MemoryPlan,
    check_fits,
    given_budget,
    memory_budget,
    plan_memory,
)
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.distributed.trackers import check_trackers
from lerobot_mg.errors import config_error
from lerobot_mg.peft.base import check_policy_path, stored_dtype
from lerobot_mg.peft.build import build_policy, processors_dir
from lerobot_mg.peft.lora import check_peft_config
from lerobot_mg.policies.base import delta_timestamps, features_from_dataset
from lerobot_mg.processors import check_tokenizers
from lerobot_mg.sim.checks import check_sim_evaluation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preflight:
    """What the checks found, for the start to reuse."""

    dims: ParallelDims
    # meta/info.json and the episodes table, read once; for dataset=mixture the plan of its sources (their merged
    # features, fps of the first)
    dataset: DatasetMeta | MixturePlan
    dataset_source: DatasetSource | None  # where it was found (dataset.root, LeRobot's cache, or downloaded); None
    # for a mixture, whose sources each record theirs (MixtureDataset.facts)
    split: EpisodeSplit  # the episodes that train and those held out for the validation loss
    resume: ResumePoint | None  # the checkpoint this start continues, or None for a new run
    memory: MemoryPlan  # per-rank bytes of the layout, from the meta-device policy
    # The training episodes as the run reads them, their dataset cache built (None for a plan or a SLURM submission)
    train_data: LeRobotDataset | MixtureDataset | None = None
    # The model FLOPs of one training sample, counted on the same meta-device policy after the plan (RunFacts'
    # flops_per_sample, which the MFU divides by); None where not counted (a plan, a submission, or an op that has
    # no meta kernel)
    flops_per_sample: int | None = None


def preflight(cfg: TrainConfig, world_size: int, rank: int = 0, local_rank: int = 0, launched: bool = False, *,
              env: Mapping[str, str] | None = None, on_this_machine: bool = True) -> Preflight:
    """Check ``cfg`` for a launch of ``world_size`` processes (``launched``: started by a launcher, which gives even
    one process a process group); raise the first user error.

    ``on_this_machine=False`` (a SLURM submission, checked on the submitting host) leaves out what only the
    machine that trains can answer: its launch environment and whether the training state fits its memory.
    """
    if on_this_machine:
        check_accelerate_env(env)
    world_size = planned_world_size(cfg, world_size)
    dims = ParallelDims.resolve(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, world_size, rank, local_rank,
                                launched)
    validate(cfg, dims.is_sharded)
    check_resume_request(cfg.resume, cfg.config_path)
    check_output_dir(cfg)
    check_device(cfg)
    check_trackers(cfg.trackio)
    check_finetune(cfg, dims.is_sharded)
    if on_this_machine:  # the machine that trains pushes (a submitting host's environment may differ)
        check_publish(cfg, env)
    if cfg.dataset.name == DatasetName.mixture:
        source, (dataset, split) = None, check_mixture(cfg, dims.dp_world_size, env)
    else:
        source = resolve_dataset(cfg.dataset, env)  # a Hub dataset: downloaded once per node if not cached
        dataset, split = check_dataset(cfg, dims.dp_world_size, Path(source.root))
    check_sim_evaluation(cfg, dataset.features)
    resume = resume_point(cfg.config_path, cfg.steps) if cfg.resume else None
    if on_this_machine and not cfg.plan:  # a plan needs no tokenizer (a gated one may not be fetched yet)
        check_tokenizers(cfg.policy, processors_dir(cfg, resume.step_dir if resume else None), env)
    policy = meta_policy(cfg, dataset)
    memory = plan_memory(cfg, dims, policy)  # the wrap, checkpointing and compile units are chosen (and checked) here
    if on_this_machine and not cfg.plan:
        check_fits(memory, memory_budget(memory.on_device, dims.local_rank))
    if cfg.plan:  # the printout says whether the plan fits
        memory = replace(memory, budget=plan_budget(cfg, memory, dims.local_rank))
    trains_here = on_this_machine and not cfg.plan
    train_data = open_training_data(cfg, dataset, split, policy, dims.local_rank, env) if trains_here else None
    flops = count_flops_per_sample(policy, cfg.batch_size, dims.is_main_process) if trains_here else None
    return Preflight(dims, dataset, source, split, resume, memory, train_data, flops)


def count_flops_per_sample(meta_model: nn.Module, batch_size: int, is_main: bool) -> int | None:
    """The model FLOPs of one training sample, counted on ``meta_model`` (the run's policy on the meta device, used
    up by the count); None, said once on the main process, where they cannot be counted (no MFU then)."""
    flops, how = training_flops_per_sample(meta_model, batch_size)
    if flops is None and is_main:
        logger.warning("Model FLOPs per sample %s: the ledger records no MFU.", how)
    return flops


def planned_world_size(cfg: TrainConfig, launched: int) -> int:
    """The world the start plans for: ``plan_world_size`` with ``plan=true``, else the launched one."""
    for key in ("plan_world_size", "plan_device_memory_gib"):
        value = getattr(cfg, key)
        if value is not None and not cfg.plan:
            raise config_error(key, value, "only applies to a plan (nothing would read it)", f"add plan=true, or drop {key}")
        if value is not None and value <= 0:
            raise config_error(key, value, "must be positive", f"{key}=<a positive number>, or drop it")
    if cfg.plan_world_size is None:
        return launched
    degrees = (cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard)
    if None not in degrees and -1 not in degrees and degrees[0] * degrees[1] != cfg.plan_world_size:
        raise config_error("plan_world_size", cfg.plan_world_size,
                           f"the layout asks for dp_replicate x dp_shard = {degrees[0] * degrees[1]} ranks",
                           f"plan_world_size={degrees[0] * degrees[1]}, or parallelism.dp_shard=-1 (shard over all)")
    return cfg.plan_world_size


def plan_budget(cfg: TrainConfig, memory: MemoryPlan, local_rank: int) -> MemoryBudget | None:
    """What ``plan=true`` checks the fit against: ``plan_device_memory_gib``, else this machine's GPU or host RAM
    (None: a GPU plan made on a machine without a GPU)."""
    if cfg.plan_device_memory_gib is not None:
        return given_budget(cfg.plan_device_memory_gib)
    if memory.on_device and not torch.cuda.is_available():
        return None
    return memory_budget(memory.on_device, local_rank)


def check_output_dir(cfg: TrainConfig) -> None:
    """A new run never writes into another run's directory."""
    if not cfg.resume and cfg.output_dir is not None and Path(cfg.output_dir).is_dir():
        if any(Path(cfg.output_dir).iterdir()):
            raise config_error(
                "output_dir", cfg.output_dir,
                "already exists and is not empty; two runs must never share a run directory",
                "a new output_dir, or resume=true config_path=<output_dir>/checkpoints/last/pretrained_model/"
                "train_config.json",
            )


def check_device(cfg: TrainConfig) -> None:
    """The precision and torch.compile asked for, against this machine's device and torch build."""
    acc = cfg.accelerator
    cpu = use_cpu(acc)
    unsupported = precision_unsupported(acc.mixed_precision, use_cpu=cpu)
    if unsupported is not None:
        raise config_error("accelerator.mixed_precision", acc.mixed_precision, *unsupported)
    if acc.compile:
        reason = compile_unavailable_reason(use_cpu=cpu)
        if reason is not None:
            raise config_error("accelerator.compile", True, reason, "accelerator.compile=false")


def check_finetune(cfg: TrainConfig, sharded: bool) -> None:
    """``policy.path`` and ``peft.*``: the base on disk and the module names it has."""
    if cfg.policy.path is not None:
        check_policy_path(cfg.policy.path)
    if not cfg.peft.enabled:
        return
    check_peft_config(cfg, sharded)
    dtype = stored_dtype(str(cfg.policy.path))
    if sharded and dtype in (torch.bfloat16, torch.float16) and cfg.accelerator.mixed_precision == "no":
        raise config_error(
            "accelerator.mixed_precision", cfg.accelerator.mixed_precision,
            f"the base at policy.path is stored in {str(dtype).removeprefix('torch.')}, and FSDP2 shards the "
            "fp32 LoRA adapters with it; with mixed precision on, every trainable parameter is upcast to fp32",
            f"accelerator.mixed_precision={'fp16' if dtype == torch.float16 else 'bf16'}",
        )


def check_publish(cfg: TrainConfig, env: Mapping[str, str] | None) -> None:
    """``policy.repo_id`` publishes at the end of training: refuse now a run whose upload could never happen
    (offline, no token), and one that keeps no final checkpoint to upload."""
    if not cfg.policy.publishes:
        return
    refusal = hub_write_refusal(env)
    if refusal is not None:
        raise config_error("policy.repo_id", cfg.policy.repo_id, *refusal)
    if not cfg.checkpoint.save_checkpoint:
        raise config_error("policy.repo_id", cfg.policy.repo_id,
                           "publishes the final checkpoint, which checkpoint.save_checkpoint=false never writes",
                           "checkpoint.save_checkpoint=true, or policy.push_to_hub=false")


def check_mixture(cfg: TrainConfig, dp_world_size: int, env: Mapping[str, str] | None) -> tuple[MixturePlan, EpisodeSplit]:
    """``dataset=mixture``: each source found (LeRobot's cache or the Hub, as ``dataset.repo_id``), read and checked
    as one dataset is, then against each other and the policy (:func:`lerobot_mg.data.mixture.plan_mixture`)."""
    data = cfg.dataset
    if not data.sources:
        raise config_error("dataset.sources", data.sources, "dataset=mixture draws from a list of datasets, and none is "
                           "given", "'dataset.sources=[{root: /data/a, weight: 0.7}, {repo_id: user/b, weight: 0.3}]'")
    for key in ("root", "repo_id", "episodes"):
        if getattr(data, key) is not None:
            raise config_error(f"dataset.{key}", getattr(data, key), "is a single dataset's setting; a mixture reads "
                               "each source's own", f"dataset.sources.<i>.{key}=..., and drop dataset.{key}")
    if data.val_episodes is not None:
        raise config_error("dataset.val_episodes", data.val_episodes, "holds episodes out of one dataset; a mixture's "
                           "validation split is not supported", "drop dataset.val_episodes (hold episodes out with "
                           "dataset.sources.<i>.episodes and evaluate the checkpoint on them)")
    if data.stats is MixtureStats.per_source and cfg.eval.n_episodes > 0:
        raise config_error("dataset.stats", str(data.stats), "normalises each sample with its own source's statistics, "
                           "but an evaluation in simulation runs the policy with the merged ones it never trained with",
                           "eval.n_episodes=0 (evaluate the checkpoint with the source's policy_preprocessor_<source>"
                           ".json), or dataset.stats=merged")
    metas, found_at, num_samples = [], [], 0
    for position, source in enumerate(data.sources):
        scope = f"dataset.sources.{position}"  # the config group its user errors name, as the source's own keys
        if (source.root is None) == (source.repo_id is None):
            raise config_error(scope, {"root": source.root, "repo_id": source.repo_id},
                               "names a dataset by exactly one of root and repo_id",
                               f"{scope}.root=<dir>, or {scope}.repo_id=<user>/<name>")
        found = resolve_dataset(DatasetConfig(name=DatasetName.lerobot, root=source.root, repo_id=source.repo_id,
                                              revision=source.revision), env, scope)
        meta = DatasetMeta.read(found.root, scope=scope)
        if source.episodes is not None and not source.episodes:
            raise config_error(f"{scope}.episodes", [], "selects no episode", f"{scope}.episodes=null (all of them), or "
                               "a list of episode indices")
        lengths = meta.lengths(source.episodes)
        _check_lengths(cfg, lengths, scope)
        metas.append(meta)
        found_at.append(found)
        num_samples += sum(lengths.values())
    plan = plan_mixture(data, metas, cfg.policy, found_at)
    cfg.policy.check_features(*features_from_dataset(plan.features, cfg.policy.observation_keys))
    _check_samples(cfg, dp_world_size, num_samples, "dataset.sources", [s.name for s in plan.sources], "the mixture")
    return plan, EpisodeSplit(None, [])


def _check_lengths(cfg: TrainConfig, lengths: dict[int, int], scope: str) -> None:
    """Each sample loads the policy's action chunk: the shortest episode (of ``lengths``, the episodes read of the
    dataset given in the config group ``scope``) holds at least one."""
    chunk = len(cfg.policy.action_delta_indices)
    shortest = min(lengths.values())
    if chunk > shortest:
        key = f"policy.{cfg.policy.action_length_key}"
        raise config_error(
            key, getattr(cfg.policy, cfg.policy.action_length_key),
            f"each sample loads {chunk} action frames, more than the shortest episode of {dataset_name(scope)} has "
            f"({shortest} frames, episode {min(lengths, key=lengths.__getitem__)}): most of its chunks would be padding",
            f"{key}=<at most {shortest}>, or {scope}.episodes=<longer episodes>",
        )


def _check_samples(cfg: TrainConfig, dp_world_size: int, num_samples: int, key: str, value: object,
                   where: str) -> None:
    """Every data-parallel rank gets a sample, and one global batch fits in the dataset: ``key=value`` names it
    (``dataset.root``, or a mixture's ``dataset.sources``), ``where`` in the batch's message."""
    if dp_world_size > num_samples:
        raise config_error(
            key, value,
            f"has {num_samples} samples, fewer than the {dp_world_size} data-parallel ranks launched: some ranks "
            "would get no sample at all",
            f"launch at most {num_samples} processes, or a larger dataset",
        )
    if cfg.batch_size * dp_world_size > num_samples:
        raise config_error(
            "batch_size", cfg.batch_size,
            f"one global batch (batch_size x {dp_world_size} data-parallel ranks = {cfg.batch_size * dp_world_size} "
            f"samples) is larger than the {num_samples} samples of {where}",
            f"batch_size={num_samples // dp_world_size}, or fewer processes",
        )


def check_dataset(cfg: TrainConfig, dp_world_size: int, root: Path) -> tuple[DatasetMeta, EpisodeSplit]:
    """The dataset's metadata against the policy and the batch: the version, the features the policy reads, the
    held-out episodes, the training episodes' lengths and the number of samples. Returns the metadata, read once,
    and the split."""
    fix = ("generate it first: lerobot-mg-make-dataset (or make train does it)"
           if cfg.dataset.name == DatasetName.embedded
           else "dataset.root=<a LeRobot v3.0 dataset directory containing meta/info.json>")
    meta = DatasetMeta.read(root, fix)
    cfg.policy.check_features(*features_from_dataset(meta.features, cfg.policy.observation_keys))
    split = split_episodes(meta, cfg.dataset.episodes, cfg.dataset.val_episodes)
    lengths = meta.lengths(split.train)
    _check_lengths(cfg, lengths, DATASET_SCOPE)
    name = dataset_name(DATASET_SCOPE)
    _check_samples(cfg, dp_world_size, sum(lengths.values()), name, str(meta.root), name)
    return meta, split


def open_training_data(cfg: TrainConfig, meta: DatasetMeta | MixturePlan, split: EpisodeSplit, policy: nn.Module,
                       local_rank: int, env: Mapping[str, str] | None = None) -> LeRobotDataset | MixtureDataset:
    """The training episodes as the run reads them (the policy's features, images as uint8), with their dataset
    cache entries built here, before any process group exists: a first build on a large dataset takes minutes
    (logged column by column), which the other nodes' ranks would otherwise spend in a collective that times out.
    The validation episodes' entry is built too, for the evaluator to open. The first rank of each machine first
    removes what the cache's retention rule no longer keeps (``lerobot_mg.data.cache.clean``). A mixture opens each
    source and merges their statistics for the normaliser; each source's map into them is given by the start once
    the normaliser exists (``MixtureDataset.set_normalisation``)."""
    days = cache.keep_days(env)
    if local_rank == 0:
        cleaned = cache.clean(days)
        if cleaned.unused or cleaned.abandoned:
            logger.info("dataset cache: removed %d entries unused for %g days and %d folders of killed builds",
                        len(cleaned.unused), days, len(cleaned.abandoned))
    keys = cfg.policy.data_keys([*policy.input_features, *policy.output_features], meta.features)
    if isinstance(meta, MixturePlan):
        return MixtureDataset(meta, functools.partial(delta_timestamps, cfg.policy, meta.features), keys)
    deltas = delta_timestamps(cfg.policy, meta.features, meta.fps)
    if split.val:
        LeRobotDataset(meta, deltas, split.val, keys=keys, uint8_visuals=True)
    return LeRobotDataset(meta, deltas, split.train, keys=keys, uint8_visuals=True)


def meta_policy(cfg: TrainConfig, meta: DatasetMeta) -> nn.Module:
    """The run's policy on the meta device: module names, classes and shapes only, no memory and no draw from the
    random generator."""
    with torch.device("meta"):
        return build_policy(cfg, meta.features, weights=False)

