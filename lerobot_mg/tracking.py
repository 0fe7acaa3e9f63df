"""What a run records as it goes: loop counters, per-update sample digests, metrics reduced across ranks, the
ledger, metrics.jsonl / wandb and the progress bar, behind one object so the loop stays short."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lerobot_mg.accounting.ledger import BatchArithmetic, ResumeCause, RunLedger, sample_digest
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.data.sampler import ResumableBatchSampler
from lerobot_mg.distributed.metrics import IntervalMetrics, MetricsLogger
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.optim import describe_schedule
from lerobot_mg.step import StepLogs


@dataclass
class Progress:
    """Loop counters; saved in training_step.json and recorded in the ledger."""

    step: int = 0
    samples_seen: int = 0
    optimizer_updates: int = 0
    skipped_updates: int = 0  # fp16 overflow: the scaler skipped the optimizer step


class RunTracker:
    def __init__(self, cfg: TrainConfig, dims: ParallelDims, arithmetic: BatchArithmetic,
                 sampler: ResumableBatchSampler, output_dir: Path, train_config: dict[str, Any], progress: Progress,
                 device: torch.device):
        self.cfg, self.dims, self.arithmetic, self.sampler, self.progress = cfg, dims, arithmetic, sampler, progress
        self.ledger = RunLedger(output_dir, dims.is_main_process)
        self.metrics_log = MetricsLogger(
            output_dir, dims.is_main_process, cfg.logging.wandb.mode, cfg.logging.wandb.project,
            cfg.logging.wandb.entity, cfg.logging.wandb.group, f"{cfg.job_name}-{output_dir.name}", train_config,
        )
        self.interval = IntervalMetrics(dims, device)
        self.last_metrics: dict[str, float] = {"loss": math.nan}
        self._digest_indices: list[int] = []
        self._last_grad_norm = math.nan
        self._bar = None
        if cfg.logging.progress_bar and dims.is_main_process:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=cfg.steps, initial=progress.step, desc="train", unit="step", dynamic_ncols=True)
        self._start = time.perf_counter()

    def record_start(self, resumed_from: Path | None, run_facts: dict, continuation: str | None,
                     model: dict[str, Any], resume_cause: ResumeCause | None) -> None:
        p, cfg = self.progress, self.cfg
        self.ledger.record_start(
            kind="resume" if resumed_from else "start", loop_step=p.step, samples_seen=p.samples_seen,
            optimizer_updates=p.optimizer_updates, arithmetic=self.arithmetic, topology=self.dims.to_dict(),
            world_size=self.dims.world_size, precision=cfg.accelerator.mixed_precision,
            code_revision=run_facts["code_revision"], dataset_fingerprint=run_facts["dataset_fingerprint"],
            checkpoint_format=cfg.checkpoint.format, resumed_from=str(resumed_from) if resumed_from else None,
            lr_schedule=describe_schedule(cfg.optimizer, cfg.scheduler, cfg.steps), sampler_continuation=continuation,
            model=model,
            resume_cause=resume_cause,
        )

    def step_done(self, logs: StepLogs, epoch: int, offset: int) -> None:
        """Account for one finished loop step that consumed the global batch at (epoch, offset). Collective on
        log steps: every rank must call it after every loop step."""
        p, cfg = self.progress, self.cfg
        p.step += 1
        p.samples_seen += self.arithmetic.samples_per_loop_step
        self.interval.add(logs.losses, cfg.batch_size)
        # The global batch, known from the sampler without communication; only the main process records it.
        if cfg.logging.record_sample_digests and self.dims.is_main_process:
            self._digest_indices += self.sampler.permutation(epoch)[offset : offset + self.sampler.global_batch_size].tolist()
        if logs.synced:
            self._last_grad_norm = logs.grad_norm
            p.optimizer_updates += 1
            p.skipped_updates += int(logs.skipped)
            if self._digest_indices:
                self.ledger.record_update(optimizer_update=p.optimizer_updates, loop_step=p.step,
                                          digest=sample_digest(self._digest_indices),
                                          num_samples=len(self._digest_indices))
            self._digest_indices = []
        if p.step % cfg.log_freq == 0 or p.step == cfg.steps:
            self._log(logs.lr)
        if self._bar is not None:
            self._bar.update(1)

    def _log(self, lr: float) -> None:
        p = self.progress
        reduced = self.interval.reduce()  # collective
        reduced.update(lr=lr, samples_seen=p.samples_seen, optimizer_updates=p.optimizer_updates,
                       skipped_updates=p.skipped_updates)
        if math.isfinite(self._last_grad_norm):  # the last update's (clipping off: not computed)
            reduced["grad_norm"] = self._last_grad_norm
        self.metrics_log.log(p.step, reduced)
        self.ledger.record_interval(
            loop_step=p.step, samples_seen=p.samples_seen, optimizer_updates=p.optimizer_updates,
            effective_batch_size=self.arithmetic.effective_batch_size, lr=lr, loss=reduced["loss"],
            wall_time_s=time.perf_counter() - self._start,
            extra={k: v for k, v in reduced.items() if k not in ("loss", "lr")},
        )
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{reduced['loss']:.4f}", lr=f"{lr:.2e}")
        self.last_metrics = reduced

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self.ledger.close()
        self.metrics_log.close()
