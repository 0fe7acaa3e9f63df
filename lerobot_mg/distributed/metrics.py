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

    def reduce(self, exact_sums: list[float] | None = None,
               maxima: dict[str, float] | None = None) -> tuple[dict[str, float], list[float]]:
        """Loss-like values averaged over ranks and steps; ``samples_per_s`` cluster-wide; ``exact_sums`` (integers
        below 2**53, e.g. digest halves, or a value only one rank gives, the others 0.0) summed over ranks in the same
        all-reduce; ``maxima`` (one rank's figures, the same keys on every rank) as their maximum over ranks, in one
        all-reduce with the interval's peak device memory (``peak_device_memory_gb``, CUDA only). Collective: every
        rank must call it at the same loop step, with as many ``exact_sums`` and the same ``maxima`` keys. Resets the
        interval."""
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
        out["samples_per_s"] = total_samples / max(elapsed, 1e-9)
        largest = dict(maxima or {})
        if self.device.type == "cuda":  # the interval's peak: reset for the next one below
            largest["peak_device_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
            torch.cuda.reset_peak_memory_stats(self.device)
        if largest:
            keys_max = sorted(largest)
            packed_max = torch.tensor([largest[k] for k in keys_max], dtype=torch.float64, device=self.device)
            if self.dims.is_distributed:
                dist.all_reduce(packed_max, op=dist.ReduceOp.MAX)
            out.update(zip(keys_max, packed_max.tolist()))
        if "peak_device_memory_gb" in out:
            out["peak_device_memory_gb"] = round(out["peak_device_memory_gb"], 3)
        self._sums, self._num_steps, self._num_samples = {}, 0, 0
        self.start = time.perf_counter()
        return out, values[len(keys) : len(keys) + len(extra)]

