"""Evaluation during training, on every layout: rollouts in simulation spread over the ranks and the loss on the
held-out episodes split over them, every ``eval.freq`` loop steps and at the last one.

At an evaluation step every rank takes part (:meth:`Evaluator.after_step` is collective there). What evaluates:

- a sharded policy (FSDP2/HSDP) is evaluated through the sharded model itself, so no rank ever holds the whole
  model: every forward gathers one unit at a time, as in training, which makes each forward a collective. The ranks
  therefore call the policy in lockstep (:class:`Lockstep`): before each forward they agree whether any rank still
  needs one, and a rank whose share is done (or failed) runs the same forward on its last input, discarding the
  result, until none does. With ``ema.use_for_eval`` each rank swaps the averages of its shards into the parameters
  for the evaluation and back afterwards. Under mixed precision the forward computes in the compute dtype, as the
  trained model does;
- an unsharded policy (DDP, one process) evaluates a copy: the full weights are gathered into CPU memory (as a
  ``safetensors`` save gathers them) and each rank builds an unsharded copy of the policy from them, in eval mode.

Then each rank rolls out its share of the episodes (episode ``i`` of seeds ``eval.seed_start + i`` goes to rank
``i % world_size``; the set of seeds does not depend on the world size; a sharded rank left without an episode
rolls out one extra seed whose result is dropped, so that it has an input to keep pace with) and computes the loss
of its share of the validation batches (batch ``b`` to rank ``b % world_size``; the batches are fixed by ``seed``
and ``eval.val_batch_size``, not by the layout). The per-episode results and per-batch loss sums are gathered on
every rank and combined in seed and batch order: the success rate with its count, mean return and episode length,
and the validation loss as the sum of the batches' ``loss x samples`` over the samples. The figures are the same for
any topology holding the same weights, and equal those of a one-process evaluation of the checkpoint saved at that
step.

Training is left as it was: the training weights are only read (a sharded model's mode and EMA swap are restored),
every random generator (torch's on the CPU and the device, numpy's, Python's) is forked around the evaluation, and
a copy is freed afterwards; the final weights are bit-identical to those of the same run without evaluation. A rank
whose share raises (a rollout that crashes) does not leave the others waiting: it keeps pace until the others are
done, its failure travels in the gather, and every rank raises :class:`EvaluationError` naming the rank and the
episode's seed. A rank that hangs or dies is bounded by ``accelerator.process_group_timeout_s`` like any collective.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lerobot_mg.accounting.ledger import EvalMetrics
from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.state import write_json
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.data.sampler import sample_seeds
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.ema import ModelEMA
from lerobot_mg.peft.build import build_policy
from lerobot_mg.policies.base import SAMPLE_SEED_KEY, delta_timestamps
from lerobot_mg.run_facts import Progress
from lerobot_mg.sim.env import EPISODE_LENGTH
from lerobot_mg.sim.evaluate import (
    EpisodeProgress,
    EpisodeResult,
    PolicyController,
    RolloutError,
    rollout_episodes,
    summarize,
)
from lerobot_mg.step import to_device

logger = logging.getLogger(__name__)

EVAL_DIR = "eval"  # <run>/eval/<step>/eval_info.json (+ videos/) per evaluation; <run>/eval_info.json: the last


class EvaluationError(RuntimeError):
    """A rank's share of an evaluation failed; raised on every rank, naming the rank (and the episode's seed)."""


def gather_full_weights(policy: nn.Module, ema: ModelEMA | None = None) -> dict[str, torch.Tensor]:
    """The policy's full state dict (every parameter and persistent buffer, under its module name) as new CPU
    tensors, on every rank; with ``ema``, its averages in place of the trainable parameters, swapped in as a
    checkpoint's pretrained_model_ema/ swaps them (:meth:`ModelEMA.swap_into`: an average the state dict has no
    entry for is refused). Collective under FSDP/HSDP: one all-gather per sharded tensor, in state-dict order, which
    is the same on every rank."""
    gathered = {}
    state = get_model_state_dict(policy)
    if ema is not None:
        ema.swap_into(state)  # this rank's shards of the averages in place of the weights': nothing gathered yet
    for name, value in state.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        gathered[name] = full.detach().to("cpu", copy=True)
    return gathered


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the same memory), a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def reshard(model: nn.Module) -> None:
    """Free every gathered unit of a sharded model (FSDP2 keeps the root gathered after a forward without backward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def own_generators(device: torch.device) -> Iterator[None]:
    """Every random generator training draws from, as it was before: torch's (CPU and ``device``), numpy's and
    Python's."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        yield
    np.random.set_state(numpy_state)
    random.setstate(python_state)


@dataclass(frozen=True)
class ValidationBatches:
    """The fixed batches of the validation loss: the held-out samples in an order drawn from ``seed``, cut into
    batches of ``batch_size`` (the last may be smaller), the first ``num_batches`` of them (None: all)."""

    dataset: LeRobotDataset
    batch_size: int
    seed: int
    num_batches: int | None = None
    batches: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed)).tolist()
        batches = [order[start:start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        object.__setattr__(self, "batches", batches[:self.num_batches])

    def loss_sums(self, policy: Callable[[dict[str, Any]], tuple[torch.Tensor, Any]], preprocessor: Any,
                  device: torch.device, rank: int, world_size: int, num_workers: int = 0,
                  pad: bool = False) -> dict[int, tuple[float, int]]:
        """``{batch number: (loss x samples, samples)}`` of this rank's share (batch ``b`` to rank
        ``b % world_size``). Each sample's noise (Diffusion's) comes from its own seed, as in training. ``pad``: a
        rank without a batch computes batch 0 and drops it (a sharded evaluation needs every rank's forward)."""
        mine = list(range(rank, len(self.batches), world_size))
        padding = pad and not mine and bool(self.batches)
        numbers = [0] if padding else mine
        if not numbers:
            return {}
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=[self.batches[b] for b in numbers],
                                             num_workers=num_workers, generator=torch.Generator())
        uint8_keys = self.dataset.visual_keys if self.dataset.uint8_visuals else ()  # scaled on the device
        sums = {}
        with torch.no_grad():
            for number, batch in zip(numbers, loader):
                batch = {**batch, SAMPLE_SEED_KEY: sample_seeds(self.seed, 0, batch["index"])}
                loss, _ = policy(preprocessor(to_device(batch, device, uint8_keys)))
                count = len(batch["index"])
                if not padding:
                    sums[number] = (float(loss) * count, count)
        return sums


class Lockstep:
    """Calls of a sharded model that every rank makes together (each forward gathers units: a collective).

    Each call first agrees with the other ranks that some rank needs a forward; :meth:`drain`, called by a rank
    whose share is done, keeps answering with the same forward on its last input (the policy's ``example_batch``
    if its share failed before its first call) until no rank needs one. So ranks
    with different numbers of forwards (episodes of different lengths, uneven shares) never wait on each other.
    Collective: every rank of the group goes through the same sequence of agreements."""

    def __init__(self, forward: Callable[..., Any], device: torch.device,
                 example: Callable[[], dict[str, torch.Tensor]]) -> None:
        self.forward, self.device = forward, device
        self.example = example  # an input for a rank that never had one (its share failed before its first call)
        self.last: tuple[Any, ...] | None = None

    def _agree(self, wants: bool) -> bool:
        flag = torch.tensor([int(wants)], device=self.device)
        dist.all_reduce(flag)  # the default group: its backend map serves this device's tensors
        return bool(flag.item())

    def __call__(self, *args: Any) -> Any:
        self._agree(True)
        self.last = args
        return self.forward(*args)

    @torch.no_grad()
    def drain(self) -> None:
        """Keep pace with the other ranks until none needs a forward (results dropped)."""
        while self._agree(False):
            if self.last is None:
                self.last = (self.example(),)
            self.forward(*self.last)


def validation_loss(sums: dict[int, tuple[float, int]]) -> tuple[float, int]:
    """(loss, samples) from the per-batch sums of every rank: summed in batch order, so the figure does not depend
    on how the batches were shared out."""
    total = count = 0.0
    for number in sorted(sums):
        total, count = total + sums[number][0], count + sums[number][1]
    return total / count, int(count)


@dataclass
class RankShare:
    """What one rank evaluated, gathered on every rank."""

    rank: int
    episodes: list[EpisodeResult] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    val_sums: dict[int, tuple[float, int]] = field(default_factory=dict)
    failure: str | None = None


class Evaluator:
    """Evaluates the training policy (its EMA weights with ``ema``) at the evaluation steps of ``cfg``: rollouts of
    ``eval.n_episodes`` and the loss on ``val_episodes`` of ``meta``'s dataset. ``record(progress, metrics, seconds)`` (the
    tracker) receives each result on every rank. ``final`` holds the last evaluation's report (eval_info.json)."""

    def __init__(self, cfg: TrainConfig, dims: ParallelDims, device: torch.device, policy: nn.Module,
                 processors: tuple[Any, Any], meta: DatasetMeta, val_episodes: list[int], output_dir: Path,
                 record: Callable[[Progress, EvalMetrics, float], None], ema: ModelEMA | None = None) -> None:
        self.cfg, self.dims, self.device, self.policy, self.processors = cfg, dims, device, policy, processors
        self.features, self.output_dir, self.record = meta.features, output_dir, record
        # The EMA weights where the run keeps them (ema.use_for_eval), else the trained ones.
        self.ema = ema if cfg.ema.use_for_eval else None
        ev = cfg.eval
        self.val = None
        if val_episodes:  # read as the training dataset is: the policy's features, images as uint8
            val = LeRobotDataset(meta, delta_timestamps(cfg.policy, meta.features, meta.fps), val_episodes,
                                 keys=cfg.policy.data_keys([*policy.input_features, *policy.output_features],
                                                           meta.features), uint8_visuals=True)
            self.val = ValidationBatches(val, ev.val_batch_size or cfg.batch_size, cfg.seed, ev.val_batches)
        self.seeds = list(range(ev.seed_start, ev.seed_start + ev.n_episodes))
        self.final: dict[str, Any] | None = None
        if ev.freq > 0 and not self.seeds and self.val is None and dims.is_main_process:
            # Not refused: a preset's eval.freq (experiment=aloha_state) with eval.n_episodes=0 typed to turn off
            # the simulation is a run without evaluation.
            logger.warning("eval.freq=%d evaluates nothing: eval.n_episodes=0 and no dataset.val_episodes.", ev.freq)

    def is_eval_step(self, step: int) -> bool:
        if not self.seeds and self.val is None:
            return False
        return step == self.cfg.steps or (self.cfg.eval.freq > 0 and step % self.cfg.eval.freq == 0)

    def after_step(self, progress: Progress, stopping: bool) -> EvalMetrics | None:
        """Evaluate if ``progress.step`` is an evaluation step (not when the run is stopping on a signal: its grace
        time is for the checkpoint). Collective there: every rank calls it after every loop step."""
        if stopping or not self.is_eval_step(progress.step):
            return None
        started = time.perf_counter()
        step_dir = self.output_dir / EVAL_DIR / L.step_dir_name(progress.step)
        if self.dims.is_sharded:  # through the sharded model: collective at every forward
            with own_generators(self.device), self._sharded_for_eval():
                share = self._evaluate_sharded(step_dir)
        else:
            weights = gather_full_weights(self.policy, self.ema)  # DDP and one process: each rank its own copy
            with own_generators(self.device):
                share = self._evaluate_share(weights, step_dir)
            del weights
        shares: list[RankShare] = [share]
        if self.dims.is_distributed:
            shares = [RankShare(rank) for rank in range(self.dims.world_size)]
            dist.all_gather_object(shares, share)  # collective: every rank's results, or its failure
        failures = [s.failure for s in shares if s.failure is not None]
        if failures:
            raise EvaluationError(f"evaluation at loop step {progress.step} failed: {'; '.join(failures)}")
        report, metrics = self._combine(shares, time.perf_counter() - started)
        if self.dims.is_main_process:
            step_dir.mkdir(parents=True, exist_ok=True)
            write_json(step_dir / "eval_info.json", {"loop_step": progress.step, **report})
            if progress.step == self.cfg.steps:
                write_json(self.output_dir / "eval_info.json", report)
        self.final = report
        self.record(progress, metrics, time.perf_counter() - started)
        return metrics

    def _evaluate_share(self, weights: dict[str, torch.Tensor], step_dir: Path) -> RankShare:
        """This rank's rollouts and validation batches with an unsharded copy of ``weights``; a failure is caught
        and reported in the share, so that no rank waits for one that failed."""
        rank, world = self.dims.rank, self.dims.world_size
        share, what = RankShare(rank), f"rank {rank}"
        try:
            what = f"rank {rank} (building the unsharded copy)"
            policy = build_policy(self.cfg, self.features, weights=False)
            policy.load_state_dict(weights)
            policy.to(self.device).eval()
            preprocessor, postprocessor = (copy.deepcopy(p).to(self.device) for p in self.processors)
            if self.val is not None:
                what = f"rank {rank} (validation loss)"
                share.val_sums = self.val.loss_sums(policy, preprocessor, self.device, rank, world,
                                                    self.cfg.num_workers)
            if self.seeds:
                what = f"rank {rank}"
                share.episodes, share.videos = self._rollouts(policy, preprocessor, postprocessor,
                                                              self.seeds[rank::world], step_dir)
        except RolloutError as error:
            logger.exception("Evaluation on rank %d: the rollout of episode seed %d failed.", rank, error.seed)
            share.failure = f"rank {rank}, episode seed {error.seed}: {error.__cause__!r}"
        except Exception as error:
            logger.exception("Evaluation on %s failed.", what)
            share.failure = f"{what}: {error!r}"
        return share

    @contextmanager
    def _sharded_for_eval(self) -> Iterator[None]:
        """The sharded policy in eval mode, with the EMA's averages in its shards (``ema.use_for_eval``); its mode
        and trained shards restored afterwards, every unit resharded (no rank keeps a gathered unit)."""
        policy = self.policy
        reshard(policy)
        was_training = policy.training
        backups: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if self.ema is not None:
                params = dict(policy.named_parameters())
                for name, average in self.ema.shadow.items():
                    local = _local(params[name])
                    backups[name] = local.clone()
                    local.copy_(_local(average))
        policy.eval()
        try:
            yield
        finally:
            policy.train(was_training)
            reshard(policy)
            with torch.no_grad():
                params = dict(policy.named_parameters())
                for name, backup in backups.items():
                    _local(params[name]).copy_(backup)

    def _evaluate_sharded(self, step_dir: Path) -> RankShare:
        """This rank's validation batches and rollouts through the sharded policy, in lockstep with the other
        ranks (:class:`Lockstep`); a failure is caught, reported in the share, and the rank keeps pace."""
        rank, world = self.dims.rank, self.dims.world_size
        share, what = RankShare(rank), f"rank {rank}"
        policy = self.policy
        preprocessor, postprocessor = (copy.deepcopy(p).to(self.device) for p in self.processors)

        def example() -> dict[str, torch.Tensor]:
            with torch.device(self.device):
                return policy.example_batch(1)

        if self.val is not None:
            forward = Lockstep(policy, self.device, example)
            try:
                what = f"rank {rank} (validation loss)"
                share.val_sums = self.val.loss_sums(forward, preprocessor, self.device, rank, world,
                                                    self.cfg.num_workers, pad=True)
            except Exception as error:
                logger.exception("Evaluation on %s failed.", what)
                share.failure = f"{what}: {error!r}"
            forward.drain()
        if self.seeds:
            mine = self.seeds[rank::world] or [self.seeds[-1] + 1 + rank]  # an extra seed, dropped: see the docstring
            predict = Lockstep(policy.predict_action_chunk, self.device, example)
            own = "predict_action_chunk" in vars(policy)  # FSDP's registered method, else the class's
            policy.predict_action_chunk = predict
            try:
                if share.failure is None:
                    share.episodes, share.videos = self._rollouts(policy, preprocessor, postprocessor, mine,
                                                                  step_dir)
                    share.episodes = [e for e in share.episodes if e.seed in self.seeds]
            except RolloutError as error:
                logger.exception("Evaluation on rank %d: the rollout of episode seed %d failed.", rank, error.seed)
                share.failure = f"rank {rank}, episode seed {error.seed}: {error.__cause__!r}"
            except Exception as error:
                logger.exception("Evaluation on rank %d failed.", rank)
                share.failure = f"rank {rank}: {error!r}"
            finally:
                if own:
                    policy.predict_action_chunk = predict.forward
                else:
                    del policy.predict_action_chunk
            predict.drain()
        return share

    def _rollouts(self, policy: nn.Module, preprocessor: Any, postprocessor: Any, seeds: list[int],
                  step_dir: Path) -> tuple[list[EpisodeResult], list[str]]:
        controller = PolicyController(policy, preprocessor, postprocessor, self.device)
        progress = (EpisodeProgress(len(seeds), self.cfg.logging.log_every_s, time.monotonic)
                    if self.dims.is_main_process and self.cfg.logging.progress_bar else None)
        return rollout_episodes(controller, seeds, self.seeds[:self.cfg.eval.n_video_episodes], step_dir / "videos",
                                self.cfg.eval.max_steps or EPISODE_LENGTH, progress)

    def _combine(self, shares: list[RankShare], seconds: float) -> tuple[dict[str, Any], EvalMetrics]:
        report: dict[str, Any] = {}
        sim: dict[str, Any] = {}
        if self.seeds:
            episodes = sorted((e for s in shares for e in s.episodes), key=lambda e: e.seed)
            sim = summarize(episodes, self.seeds[0], seconds, sorted(v for s in shares for v in s.videos))
            report.update(sim)
        val_loss, val_samples = None, 0
        if self.val is not None:
            val_loss, val_samples = validation_loss({n: v for s in shares for n, v in s.val_sums.items()})
            report.update(val_loss=val_loss, val_samples=val_samples, val_batches=len(self.val.batches))
        metrics = EvalMetrics(len(self.seeds), sim.get("num_successes"), sim.get("success_rate"),
                              sim.get("mean_return"), sim.get("mean_episode_length"), val_loss, val_samples)
        return report, metrics
