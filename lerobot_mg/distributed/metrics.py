"""Metrics reduced across ranks, then logged by the main process to metrics.jsonl and wandb."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lerobot_mg.distributed.parallel_dims import ParallelDims

METRICS_FILENAME = "metrics.jsonl"


class IntervalMetrics:
    """Per-rank sums over one log interval; :meth:`reduce` averages them over ranks and steps."""

    def __init__(self, dims: ParallelDims, device: torch.device):
        self.dims, self.device = dims, device
        self.start = time.perf_counter()
        self._sums: dict[str, float] = {}
        self._num_steps = 0
        self._num_samples = 0

    def add(self, values: dict[str, float], num_samples: int) -> None:
        for key, value in values.items():
            self._sums[key] = self._sums.get(key, 0.0) + float(value)
        self._num_steps += 1
        self._num_samples += num_samples

    def reduce(self) -> dict[str, float]:
        """Loss-like values averaged over ranks and steps; ``samples/s`` cluster-wide. Collective: every rank
        must call it at the same loop step. Resets the interval."""
        keys = sorted(self._sums)
        packed = torch.tensor(
            [self._sums[k] for k in keys] + [float(self._num_steps), float(self._num_samples)],
            dtype=torch.float64,
            device=self.device,
        )
        if self.dims.is_distributed:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        elapsed = time.perf_counter() - self.start
        total_steps, total_samples = packed[-2].item(), packed[-1].item()
        out = {k: packed[i].item() / max(total_steps, 1.0) for i, k in enumerate(keys)}
        out["samples/s"] = total_samples / max(elapsed, 1e-9)
        if self.device.type == "cuda":  # the largest peak over ranks
            peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 1e9], device=self.device)
            if self.dims.is_distributed:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["gpu_peak_memory_gb"] = round(peak.item(), 3)
        self._sums, self._num_steps, self._num_samples = {}, 0, 0
        self.start = time.perf_counter()
        return out


class MetricsLogger:
    """Main-process sink: one JSON line per log step in ``metrics.jsonl`` and, unless disabled, wandb."""

    def __init__(self, output_dir: Path, is_main: bool, wandb_mode: str, wandb_project: str,
                 wandb_entity: str | None, wandb_group: str | None, run_name: str, config: dict[str, Any]):
        self.is_main = is_main
        self._file = None
        self._wandb = None
        if not is_main:
            return
        self._file = open(Path(output_dir) / METRICS_FILENAME, "a")
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                mode=wandb_mode, project=wandb_project, entity=wandb_entity, group=wandb_group, name=run_name,
                dir=str(output_dir), config=config, resume="allow",
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        assert self._file is not None
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
