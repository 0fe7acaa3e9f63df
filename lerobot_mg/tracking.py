"""What a run records as it goes, behind one object so the loop stays short: loop counters, digests of what the
DataLoader delivered, what a dataset mixture drew from each source, metrics reduced across ranks, the ledger (the
run's one time series), the trackers (wandb, trackio) and the progress shown on stdout."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lerobot_mg.accounting.ledger import (
    EvalMetrics,
    EvalRecord,
    IntervalRecord,
    RunLedger,
    StartRecord,
    UpdateDigest,
)
from lerobot_mg.accounting.throughput import (
    PHASE_KEYS,
    PhaseTimes,
    compute_precision,
    model_flops_utilisation,
    peak_flops_of,
)
from lerobot_mg.checkpoint.resume import ResumePoint
from lerobot_mg.config.choices import MixtureStats
from lerobot_mg.config.schema import LoggingConfig, TrackioConfig, TrainConfig
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.distributed.metrics import IntervalMetrics
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Continuation, ParallelDims
from lerobot_mg.distributed.trackers import Trackers
from lerobot_mg.run_facts import Progress, RunFacts, percent
from lerobot_mg.step import StepLogs

logger = logging.getLogger("lerobot_mg.train")

DATA_WAIT_KEY = "data_wait_s"  # seconds the loop waited for batches in a log interval (mean over ranks)
_DIGEST_BITS = 48  # a float64 holds a sum of two 24-bit halves over up to 2**29 ranks exactly


class LoaderDigests:
    """One rank's digests of the ``index`` values its DataLoader delivered, one per optimizer update.

    The sample at position ``p`` of an update's global batch (micro-step ``k``, data-parallel rank ``r``, slot
    ``j``: ``p = k * batch_size * dp_world_size + r * batch_size + j``) hashes to ``mix(mix(index) + p)``; the
    update's digest is the sum of its samples' hashes mod 2**48. Sums add up over ranks and micro-steps, so an
    update's digest does not depend on how its global batch was split, while one wrong sample, or two swapped,
    changes it. The sums travel as exact float64 halves in the metrics reduction that log steps already do.
    """

    def __init__(self, batch: BatchArithmetic, dp_rank: int) -> None:
        self.batch, self.dp_rank = batch, dp_rank
        self._sum, self._count, self._micro_step = 0, 0, 0
        self._finished: list[tuple[int, int, int, int]] = []  # (update, loop step, sum, count)

    def add(self, index_B: torch.Tensor) -> None:
        """Account for one delivered micro-batch, by its ``index`` column."""
        index = index_B.numpy().astype(np.uint64)
        first = self._micro_step * self.batch.samples_per_loop_step + self.dp_rank * self.batch.batch_size
        with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
            hashes = _mix(_mix(index) + np.arange(first, first + len(index), dtype=np.uint64))
        self._sum = (self._sum + int(hashes.sum(dtype=np.uint64))) % (1 << _DIGEST_BITS)
        self._count += len(index)
        self._micro_step += 1

    def end_update(self, optimizer_update: int, loop_step: int) -> None:
        self._finished.append((optimizer_update, loop_step, self._sum, self._count))
        self._sum, self._count, self._micro_step = 0, 0, 0

    def pack(self) -> list[float]:
        """Per finished update: the low and high halves of this rank's sum, and its sample count."""
        half = 1 << _DIGEST_BITS // 2
        return [float(x) for _, _, total, count in self._finished for x in (total % half, total // half, count)]

    def unpack(self, summed: list[float]) -> tuple[UpdateDigest, ...]:
        """The finished updates' digests, from ``pack()`` summed over ranks; starts the next interval."""
        half, values = 1 << _DIGEST_BITS // 2, [int(x) for x in summed]
        digests = tuple(
            UpdateDigest(update, step, f"{(low + high * half) % (1 << _DIGEST_BITS):012x}", count)
            for (update, step, _, _), low, high, count in zip(self._finished, values[::3], values[1::3], values[2::3])
        )
        self._finished = []
        return digests


class SourceDraws:
    """What a dataset mixture drew from each of its sources in one log interval: samples, and distinct episodes.

    The main process knows every rank's samples of a loop step from the sampler, so it counts the whole global
    batch alone, without a collective. Episode keys are buffered and made unique every ``_COMPACT_AT`` of them,
    which bounds the memory of a long interval by the number of distinct episodes.
    """

    _COMPACT_AT = 1 << 20
    _EPISODE_BITS = 32  # a key is source << 32 | episode

    def __init__(self, names: Sequence[str], samples_per_loop_step: int) -> None:
        self.names, self.samples_per_loop_step = tuple(names), samples_per_loop_step
        self._samples = np.zeros(len(self.names), dtype=np.int64)
        self._keys: list[np.ndarray] = []
        self._buffered = 0

    def add(self, sources: np.ndarray, episodes: np.ndarray) -> None:
        """One loop step's global batch: each sample's source position and that source's episode index."""
        sources, episodes = np.asarray(sources, dtype=np.int64), np.asarray(episodes, dtype=np.int64)
        if sources.shape != (self.samples_per_loop_step,) or episodes.shape != sources.shape:
            raise ValueError(f"drawn() takes the source and episode of each of the {self.samples_per_loop_step} "
                             f"samples of a loop step's global batch, got shapes {sources.shape} and {episodes.shape}")
        if sources.min() < 0 or sources.max() >= len(self.names) or episodes.min() < 0 or (
                episodes.max() >> self._EPISODE_BITS):
            raise ValueError(f"drawn(): source positions must lie in [0, {len(self.names)}) and episode indices in "
                             f"[0, 2**{self._EPISODE_BITS}), got sources {sources.min()}..{sources.max()}, episodes "
                             f"{episodes.min()}..{episodes.max()}")
        self._samples += np.bincount(sources, minlength=len(self.names))
        self._keys.append(np.unique(sources << self._EPISODE_BITS | episodes))
        self._buffered += len(self._keys[-1])
        if self._buffered >= self._COMPACT_AT:
            self._keys = [np.unique(np.concatenate(self._keys))]
            self._buffered = len(self._keys[0])

    def take(self) -> dict[str, dict[str, int]]:
        """The interval's counts per source name, ``{"samples", "episodes"}`` (every source, drawn or not); starts
        the next interval."""
        keys = np.unique(np.concatenate(self._keys)) if self._keys else np.zeros(0, dtype=np.int64)
        episodes = np.bincount(keys >> self._EPISODE_BITS, minlength=len(self.names))
        counts = {name: {"samples": int(samples), "episodes": int(distinct)}
                  for name, samples, distinct in zip(self.names, self._samples, episodes)}
        self._samples[:] = 0
        self._keys, self._buffered = [], 0
        return counts


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that spreads every input bit over the output."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class RunTracker:
    """Counts, digests, reduces and records. Creating it writes the start/resume record."""

    def __init__(self, logging: LoggingConfig, log_freq: int, total_steps: int, facts: RunFacts,
                 progress: Progress, dims: ParallelDims, output_dir: Path, device: torch.device,
                 run_config: dict[str, Any], trackio: TrackioConfig | None = None):
        self.log_freq, self.total_steps, self.facts, self.progress = log_freq, total_steps, facts, progress
        self.ledger = RunLedger(output_dir, dims.is_main_process)
        self.is_main = dims.is_main_process
        self.ledger.write(StartRecord(time.time(), replace(progress), facts))
        # The run directory's one tracker run: a resume or a requeue continues it (distributed/trackers.py).
        self.trackers = Trackers(logging.wandb, trackio or TrackioConfig(), output_dir, dims.is_main_process,
                                 f"{run_config['job_name']}-{output_dir.name}", run_config)
        self.interval = IntervalMetrics(dims, device)
        self.phases, self.rank, self.world_size = PhaseTimes(), dims.rank, dims.world_size
        # MFU's denominator: the device's peak in the run's precision (None on a CPU or an unlisted GPU).
        self._peak_flops = (facts.device or {}).get("peak_flops")
        self.digests = LoaderDigests(facts.batch, dims.rank) if logging.record_sample_digests else None
        self.draws = (SourceDraws([source["name"] for source in facts.mixture], facts.batch.samples_per_loop_step)
                      if facts.mixture is not None else None)
        self.last_metrics: dict[str, float] = {"loss": math.nan}
        self._last_grad_norm = self._lr = math.nan
        self._skipped: int | torch.Tensor = 0  # updates the fp16 scaler skipped since the last log (device tensor)
        self._progress = (ProgressDisplay(total_steps, progress, facts.batch.samples_per_loop_step,
                                          logging.log_every_s)
                          if logging.progress_bar and dims.is_main_process else None)
        self._start = self._interval_start = time.perf_counter()
        self._interval_steps = 0

    def drawn(self, sources: np.ndarray, episodes: np.ndarray) -> None:
        """A dataset mixture's loop step: the source position (in ``dataset.sources``) and that source's episode
        index of every sample of the step's global batch, all ranks' (from the sampler). The main process calls it
        once per loop step, before ``step_done``; the interval that step ends in records the counts per source.
        Other ranks need not call it: only the main process writes the ledger."""
        if self.draws is None:
            raise ValueError("drawn() counts the draws of a dataset mixture, and this run's facts have no mixture")
        self.draws.add(sources, episodes)

    def step_done(self, logs: StepLogs, index_B: torch.Tensor, data_wait_s: float) -> None:
        """Account for one finished loop step that trained on the samples ``index_B`` (this rank's micro-batch),
        after waiting ``data_wait_s`` for them. Collective on log steps: every rank must call it after every loop
        step."""
        p = self.progress
        p.step += 1
        self._lr = logs.lr
        p.samples_seen += self.facts.batch.samples_per_loop_step
        self.interval.add({**logs.losses, DATA_WAIT_KEY: data_wait_s}, len(index_B))
        self.phases.add(data_wait_s, logs.marks)
        self._interval_steps += 1
        if self.digests is not None:
            self.digests.add(index_B)
        if logs.synced:
            self._last_grad_norm = logs.grad_norm
            p.optimizer_updates += 1
            self._skipped = self._skipped + logs.skipped  # counted on the device, read at the next log step
            if self.digests is not None:
                self.digests.end_update(p.optimizer_updates, p.step)
        log_step = p.step % self.log_freq == 0 or p.step == self.total_steps
        if log_step:
            self.end_interval()
        if self._progress is not None:
            self._progress.step_done(data_wait_s, self.last_metrics["loss"], force_line=log_step,
                                     mfu=self.last_metrics.get("mfu"))

    def end_interval(self) -> None:
        """Reduce and record the interval so far (nothing if it is empty). Collective: every rank calls it at the
        same loop step."""
        if self.interval.is_empty:
            return
        # Each phase's mean seconds per loop step on this rank: the slowest rank's in the ledger, and rank 0's
        # (summed over ranks, the others adding 0.0), which LeRobot's logs show alone.
        phases = self.phases.take(self._interval_steps)
        packed = self.digests.pack() if self.digests is not None else []
        rank0 = [phases[key] if self.rank == 0 else 0.0 for key in PHASE_KEYS]
        reduced, summed = self.interval.reduce(packed + rank0, maxima=phases)  # collective
        reduced.update({f"{key}_rank0": value for key, value in zip(PHASE_KEYS, summed[len(packed):])})
        reduced["samples_per_s_per_device"] = reduced["samples_per_s"] / self.world_size
        if self.facts.flops_per_sample is not None and self._peak_flops is not None:
            reduced["mfu"] = model_flops_utilisation(self.facts.flops_per_sample, reduced["samples_per_s_per_device"],
                                                     self._peak_flops)
        self.progress.skipped_updates += int(self._skipped)  # the flags were agreed across ranks at each update
        self._skipped, self._last_grad_norm = 0, float(self._last_grad_norm)
        reduced["lr"] = self._lr
        # The wait per step, averaged over ranks, becomes the interval's total (as LeRobot's data_s) and its share
        # of the interval's wall time: a loader that cannot keep up shows here first.
        reduced[DATA_WAIT_KEY] *= self._interval_steps
        reduced["data_frac"] = reduced[DATA_WAIT_KEY] / max(time.perf_counter() - self._interval_start, 1e-9)
        self._interval_steps, self._interval_start = 0, time.perf_counter()
        if math.isfinite(self._last_grad_norm):  # the last update's (clipping off: not computed)
            reduced["grad_norm"] = self._last_grad_norm
        updates = self.digests.unpack(summed[:len(packed)]) if self.digests is not None else ()
        sources = self.draws.take() if self.draws is not None else {}
        p = self.progress
        self.ledger.write(IntervalRecord(time.time(), replace(p), time.perf_counter() - self._start,
                                         reduced, updates, sources))
        self.trackers.log(p.step, {**reduced, "samples_seen": p.samples_seen,
                                   "optimizer_updates": p.optimizer_updates, "skipped_updates": p.skipped_updates})
        self.last_metrics = reduced

    def evaluated(self, progress: Progress, metrics: EvalMetrics, seconds: float) -> None:
        """Record an evaluation of the weights at ``progress`` (every rank calls it; the main process writes): the
        ledger's eval record, the trackers' ``eval/*`` metrics at that loop step, and one line on stdout. The
        interval's samples/s and data wait share count training time only: the evaluation's seconds are left out."""
        self.interval.start += seconds
        self._interval_start += seconds
        self.ledger.write(EvalRecord(time.time(), replace(progress), seconds, metrics))
        self.trackers.log(progress.step, {**metrics.tracker_metrics(), "eval/seconds": seconds,
                                          "samples_seen": progress.samples_seen,
                                          "optimizer_updates": progress.optimizer_updates})
        if self.is_main:
            print(describe_eval(progress, metrics, seconds), flush=True)

    def checkpoint(self) -> None:
        """Before a checkpoint: end the interval here and make the ledger durable, so a resume from the
        checkpoint finds every record up to it. Collective."""
        self.end_interval()
        self.ledger.sync()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        self.ledger.close()
        self.trackers.close()


class ProgressDisplay:
    """Training progress on stdout (main process). On a terminal, a bar; otherwise (a SLURM job's .out file, a
    redirect) one plain line every ``log_every_s`` seconds and at every log step, which a log file can hold::

        train step 300/2000 (15%) | samples 2400 | updates 300 | loss 0.4312 | 81.2 samples/s | data wait 3% | MFU 41.2% | ETA 0:00:21

    The loss and the MFU (where known: a GPU the peak table lists) are the last log step's (reading the current
    loss would cost a host sync per step); samples/s and the share of time spent waiting for data are this
    process's, since the previous line. ``clock`` is injectable for tests."""

    def __init__(self, total_steps: int, progress: Progress, samples_per_step: int, log_every_s: float,
                 terminal: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.total_steps, self.progress, self.samples_per_step = total_steps, progress, samples_per_step
        self.log_every_s, self.clock = log_every_s, clock
        self._first_step = progress.step
        self._start = self._line_time = clock()
        self._line_step, self._line_wait = progress.step, 0.0
        self._bar = None
        if sys.stdout.isatty() if terminal is None else terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=progress.step, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stdout)

    def step_done(self, data_wait_s: float, loss: float, force_line: bool, mfu: float | None = None) -> None:
        """After each loop step; ``force_line`` at a log step (a new ``loss`` and ``mfu``)."""
        if self._bar is not None:
            if force_line:
                self._bar.set_postfix(loss=f"{loss:.4f}", **({"MFU": f"{100 * mfu:.1f}%"} if mfu is not None else {}))
            self._bar.update(1)
            return
        self._line_wait += data_wait_s
        now = self.clock()
        if force_line or now - self._line_time >= self.log_every_s:
            print(self._line(now, loss, mfu), flush=True)
            self._line_time, self._line_step, self._line_wait = now, self.progress.step, 0.0

    def _line(self, now: float, loss: float, mfu: float | None = None) -> str:
        p, window = self.progress, max(now - self._line_time, 1e-9)
        rate = (p.step - self._line_step) * self.samples_per_step / window
        steps_per_s = (p.step - self._first_step) / max(now - self._start, 1e-9)
        eta = timedelta(seconds=round((self.total_steps - p.step) / steps_per_s)) if steps_per_s > 0 else "?"
        return " | ".join([
            f"train step {p.step}/{self.total_steps} ({100 * p.step // max(self.total_steps, 1)}%)",
            f"samples {p.samples_seen}", f"updates {p.optimizer_updates}",
            f"loss {loss:.4f}" if math.isfinite(loss) else "loss -",  # none before the first log step
            f"{rate:.1f} samples/s", f"data wait {100 * self._line_wait / window:.0f}%",
            *([f"MFU {100 * mfu:.1f}%"] if mfu is not None else []), f"ETA {eta}",
        ])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def device_facts(device: torch.device, mixed_precision: str, model: torch.nn.Module) -> dict[str, Any]:
    """``RunFacts.device``: the device, the run's compute precision and the device's peak FLOP/s in it."""
    return peak_flops_of(device, compute_precision(str(mixed_precision), model))


def describe_eval(progress: Progress, metrics: EvalMetrics, seconds: float) -> str:
    """An evaluation in one line: the counters of the weights it evaluated, and its figures."""
    figures = []
    if metrics.n_episodes:
        figures.append(f"success rate {metrics.success_rate:.2f} ({metrics.num_successes}/{metrics.n_episodes}), "
                       f"mean return {metrics.mean_return:.1f}, mean length {metrics.mean_episode_length:.1f}")
    if metrics.val_loss is not None:
        figures.append(f"val loss {metrics.val_loss:.4f} ({metrics.val_samples} samples)")
    return (f"eval at loop step {progress.step} ({progress.samples_seen} samples, {progress.optimizer_updates} "
            f"updates): {'; '.join(figures)} ({seconds:.1f} s)")


def log_resume(resume: ResumePoint, facts: RunFacts, position: str) -> None:
    """How exactly the sample stream continues, and every fact that changed since the checkpoint's start."""
    continuation = facts.continuation or Continuation.SAMPLE_EXACT
    # Anything but a sample-exact continuation changes what each rank trains on: say so loudly.
    level = logging.INFO if continuation is Continuation.SAMPLE_EXACT else logging.WARNING
    logger.log(level, "Data sampler resumed %s at %s: %s.", continuation.value, position, continuation.describe())
    for change in facts.changes_since(resume.facts):
        logger.warning("%s.", change.describe(f"at resume (step {resume.progress.step})"))


def print_banner(cfg: TrainConfig, facts: RunFacts, dataset: LeRobotDataset, output_dir: Path,
                  progress: Progress) -> None:
    """The run's facts and recipe on stdout (main process). ``dataset``: the single dataset trained on; a
    mixture's sources are printed from ``facts.mixture`` instead (``dataset`` is not read then)."""
    num_params, num_trainable = facts.model["total_params"], facts.model["trainable_params"]
    per_rank = ", ".join(f"{held['parameters'] / 2**20:.2f}" for held in facts.rank_bytes)
    data = ("dataset: a mixture of the sources below" if facts.mixture is not None else
            f"dataset: {dataset.root} ({len(dataset)} frames, {dataset.num_episodes} episodes)")
    lines = [f"lerobot_mg train: {cfg.job_name} -> {output_dir}", *(f"  {line}" for line in facts.describe()),
             f"  steps: {cfg.steps} loop steps = {facts.batch.sample_presentations(cfg.steps)} sample presentations, "
             f"{facts.batch.optimizer_updates(cfg.steps)} optimizer updates (lr and steps are never auto-scaled)",
             "  note: the lr schedule is stepped once per loop step on purpose (the guide's rule); each optimizer "
             "update uses the lr of its loop step",
             *(f"  {line}" for line in cfg.recipe_lines()),  # the recipe and whether the policy's preset gave it
             f"  policy: {cfg.policy.type} ({num_params:,} params, {num_trainable:,} trainable = "
             f"{100 * num_trainable / num_params:.1f}%)  {data}",
             *(f"  {line}" for line in mixture_lines(cfg, facts.mixture or ())),
             f"  parameter MiB per rank: [{per_rank}]"]
    if facts.model["base_model_path"] is not None:
        peft = facts.model["peft"]
        how = (f"{peft['method_type']} r={peft['r']} lora_alpha={peft['lora_alpha']:g} on {peft['target_modules']}"
               f", full training {peft['full_training_modules']}" if peft else "full fine-tuning")
        lines.append(f"  base model: {facts.model['base_model_path']} ({how})")
        # An adapter merged into its base: each one's weights (peft.base.base_lineage), named as the one above names it.
        lines.extend(f"    {'the adapter' if i == 0 else 'on the base'} {entry['path']}: sha256 {entry['sha256']}"
                     for i, entry in enumerate(facts.model.get("base_lineage", ())))
    if facts.continuation is not None and facts.resume_cause is not None:
        lines.append(f"  resumed at loop step {progress.step} from {facts.resumed_from} ({facts.resume_cause.value}): "
                     f"{facts.continuation.value}")
    print("\n".join(lines), flush=True)


def mixture_lines(cfg: TrainConfig, mixture: Sequence[dict]) -> list[str]:
    """What the banner says about a dataset mixture: its totals and normalisation, then one line per source with
    its weight (the probability of drawing from it, and whether dataset.sources set it or the source's share of
    frames gave it), frames, episodes and fps. Empty for a single dataset."""
    if not mixture:
        return []
    typed = list(cfg.dataset.sources or ())
    stats = cfg.dataset.stats
    normalised = "; normalised with " + {
        MixtureStats.merged: "merged statistics, one normaliser over every source (LeRobot's aggregate_stats)",
        MixtureStats.per_source: "per-source statistics, each sample with its own source's"}[stats] + (
        f" (dataset.stats={stats})")
    lines = [f"mixture sources: {len(mixture)}, {sum(s['num_frames'] for s in mixture):,} frames, "
             f"{sum(s['num_episodes'] for s in mixture):,} episodes{normalised}"]
    for position, source in enumerate(mixture):
        given = ("" if position >= len(typed) else  # the config names each source's weight, or none
                 " (its share of frames)" if getattr(typed[position], "weight", None) is None else " (weight set)")
        where = source.get("repo_id") or source.get("root")
        lines.append(f"  [{position}] {source['name']}: {percent(source['weight'])} of draws{given}, "
                     f"{source['num_frames']:,} frames, {source['num_episodes']:,} episodes, {source['fps']:g} fps"
                     f"  ({where}, {source['fingerprint']})")
    return lines
