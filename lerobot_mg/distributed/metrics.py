"""Metrics reduced across ranks: the ledger records them, and the trackers (distributed/trackers.py) get them."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lerobot_mg.distributed.parallel_dims import ParallelDims


class IntervalMetrics:
    """Per-rank sums over one log interval; :meth:`reduce` averages them over ranks and steps. Values that are
    device tensors are summed on the device and read only at :meth:`reduce` (once per log step)."""

    def __init__(self, dims: ParallelDims, device: torch.device):
        self.dims, self.device = dims, device
        self.start = time.perf_counter()
        self._sums: dict[str, float | torch.Tensor] = {}
        self._num_steps = 0
        self._num_samples = 0

    def add(self, values: dict[str, float | torch.Tensor], num_samples: int) -> None:
        for key, value in values.items():
            if isinstance(value, torch.Tensor):  # float64, as the Python floats: the same sums either way
                value = value.detach().to(torch.float64)
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._num_steps += 1
        self._num_samples += num_samples

    @property
    def is_empty(self) -> bool:
        return self._num_steps == 0

    def reduce(self, exact_sums: list[float] | None = None) -> tuple[dict[str, float], list[float]]:
        """Loss-like values averaged over ranks and steps; ``samples/s`` cluster-wide; and ``exact_sums`` (integers
        below 2**53, e.g. digest halves) summed over ranks in the same all-reduce. Collective: every rank must call
        it at the same loop step, with as many ``exact_sums``. Resets the interval."""
        keys, extra = sorted(self._sums), list(exact_sums or [])
        on_device = {i: self._sums[k] for i, k in enumerate(keys) if isinstance(self._sums[k], torch.Tensor)}
        packed = torch.tensor(
            [0.0 if i in on_device else self._sums[k] for i, k in enumerate(keys)] + extra
            + [float(self._num_steps), float(self._num_samples)],
            dtype=torch.float64,
            device=self.device,
        )
        for i, total in on_device.items():
            packed[i] = total
        if self.dims.is_distributed:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        elapsed = time.perf_counter() - self.start
        values = packed.tolist()
        total_steps, total_samples = values[-2], values[-1]
        out = {k: values[i] / max(total_steps, 1.0) for i, k in enumerate(keys)}
        out["samples/s"] = total_samples / max(elapsed, 1e-9)
        if self.device.type == "cuda":  # the largest peak over ranks
            peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 1e9], device=self.device)
            if self.dims.is_distributed:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["gpu_peak_memory_gb"] = round(peak.item(), 3)
        self._sums, self._num_steps, self._num_samples = {}, 0, 0
        self.start = time.perf_counter()
        return out, values[len(keys) : len(keys) + len(extra)]

