"""The throughput figures the field compares (docs/comparing-runs.md, "Throughput"): samples per second, the seconds a
loop step spends waiting for data, preprocessing and updating, the model FLOPs of one training sample and the model
FLOPs utilisation (MFU) against the device's peak.

Where each is measured:

- ``dataloading_s``: the host's wall time in ``next()`` on the DataLoader's iterator (lerobot_mg.train), the time the
  loop waited for its next batch.
- ``preprocessing_s``: from the start of :meth:`lerobot_mg.step.Stepper.step` to the policy's forward: the
  host-to-device copy of the batch, images to float and the preprocessor (the normaliser and the policy's other
  processor steps; the VLAs tokenise their prompts in the DataLoader workers, which is data wait).
- ``update_s``: from there to the end of the optimizer update: forward, backward, gradient reduction and clipping,
  ``optimizer.step``, ``zero_grad`` and the EMA update (the learning-rate scheduler's host-side step is left out).

On CUDA the two step phases are CUDA events recorded on the current stream (:class:`StepClock`), read once per log
interval: they time the phase on the device's timeline, which includes the time the device waited for the host to
launch the phase's work, and they add no host synchronisation to a step. Elsewhere they are ``time.perf_counter``.

FLOPs are counted once per start on the meta device (:func:`training_flops_per_sample`): one forward and backward
of the policy's ``example_batch``, without the forward that activation checkpointing recomputes (the model FLOPs of
the field's MFU, not the hardware FLOPs). MFU = ``flops_per_sample x samples/s per device / peak``, the peak being
the device's dense (no sparsity) FLOP/s in the run's compute precision (:data:`PEAK_FLOPS`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

Mark = float | torch.cuda.Event  # a point of a loop step: perf_counter seconds, or a recorded CUDA event

# Peak dense FLOP/s per device by compute precision, from the vendors' datasheets (the figures "with sparsity" halved):
# bf16/fp16 are tensor-core figures with fp32 accumulation, tf32 the tensor-core figure for float32 matmuls that
# torch runs as TF32 (torch.backends.cuda.matmul.allow_tf32), fp32 the plain float32 rate. Matched against
# torch.cuda.get_device_name() in order, first match wins: variants (PCIe, NVL) before the default (SXM).
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bGH200\b", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    (r"\bH200 NVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH200\b", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    (r"\bH100 NVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH100 PCIe\b", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    (r"\bH100\b", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),  # SXM: "H100 80GB HBM3"
    (r"\bH800\b", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    (r"\bB200\b", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 75e12}),
    (r"\bA100\b|\bA800\b", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"\bL40S\b", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"\bL40\b", {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12}),
    (r"\bL4\b", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (r"\bA10G?\b", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (r"\bA40\b", {"bf16": 149.7e12, "fp16": 149.7e12, "tf32": 74.8e12, "fp32": 37.4e12}),
    (r"RTX 6000 Ada", {"bf16": 364.2e12, "fp16": 364.2e12, "tf32": 182.1e12, "fp32": 91.1e12}),
    (r"RTX A6000", {"bf16": 154.8e12, "fp16": 154.8e12, "tf32": 77.4e12, "fp32": 38.7e12}),
    (r"RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    (r"RTX 3090", {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
    (r"\bV100\b", {"fp16": 125e12, "fp32": 15.7e12}),  # no bf16 or tf32 tensor cores
    (r"\bT4\b", {"fp16": 65e12, "fp32": 8.1e12}),
)
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def peak_flops(device_name: str, precision: str) -> float | None:
    """The peak dense FLOP/s of the device ``device_name`` (``torch.cuda.get_device_name``) in ``precision`` (one
    of :data:`PRECISIONS`); None for a device the table does not list or a precision it has no tensor cores for."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {PRECISIONS}")
    for pattern, peaks in PEAK_FLOPS:
        if re.search(pattern, device_name):
            return peaks.get(precision)
    return None


def compute_precision(mixed_precision: str, model: nn.Module) -> str:
    """The precision the run's matmuls run in: the autocast dtype under ``accelerator.mixed_precision`` bf16/fp16;
    without it the dtype most parameter elements are stored in (a base stored in bfloat16 trains in bfloat16), and
    float32 as TF32 when torch allows it (``torch.backends.cuda.matmul.allow_tf32``)."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    dtype = max(counts, key=counts.__getitem__, default=torch.float32)
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops_of(device: torch.device, precision: str) -> dict[str, Any]:
    """What MFU is measured against, for ``RunFacts.device``: the device's name (a CUDA device's, else its type),
    the precision column and the peak FLOP/s (None on a CPU, or a GPU the table does not list: no MFU)."""
    if device.type != "cuda":
        return {"name": device.type, "precision": precision, "peak_flops": None}
    name = torch.cuda.get_device_name(device)
    return {"name": name, "precision": precision, "peak_flops": peak_flops(name, precision)}


def training_flops_per_sample(meta_model: nn.Module, batch_size: int) -> tuple[int | None, str]:
    """(model FLOPs of one training sample, forward + backward; how they were counted) for ``meta_model``, a policy
    built on the meta device (lerobot_mg.preflight.meta_policy): its ``example_batch(batch_size)`` through one
    forward and one backward under torch's ``FlopCounterMode``, divided by ``batch_size``. Modules that recompute
    their forward in backward (activation checkpointing) run it once here, so the count holds no recomputation.
    ``meta_model`` is used up (its checkpointing is removed). None, with the reason, when the policy has no
    ``example_batch`` or its step does not run on the meta device."""
    make_batch = getattr(meta_model, "example_batch", None)
    if make_batch is None:
        return None, f"not counted: {type(meta_model).__name__} has no example_batch"
    for module in meta_model.modules():
        if getattr(module, "_recomputed_in_backward", False):  # lerobot_mg.policies.base.checkpoint_activations
            del module.forward  # the instance's checkpointed forward: the class's runs instead
            module._recomputed_in_backward = False
    counter = FlopCounterMode(display=False)
    try:
        with torch.device("meta"), counter, _YesOnHostReads():
            loss, _ = meta_model(make_batch(batch_size))
            loss.backward()
    except (NotImplementedError, RuntimeError) as error:  # an op without a meta kernel, data read on the host
        return None, (f"not counted: {type(meta_model).__name__}'s training step does not run on the meta device "
                      f"({type(error).__name__}: {str(error).splitlines()[0]})")
    total = counter.get_total_flops()
    return total // batch_size, (f"one forward and backward of {batch_size} samples of example_batch on the meta "
                                 "device (torch FlopCounterMode), without activation recomputation")


class _YesOnHostReads(TorchDispatchMode):
    """A meta tensor read on the host as a yes/no (a bool tensor's ``item()``, such as transformers' "is every
    position valid" before its vision tower's attention) answers yes; any other read stays an error. The meta
    device holds no values, and such a check only chooses between computations of the same FLOPs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta
                and args[0].dtype == torch.bool):
            return True
        return func(*args, **(kwargs or {}))


def model_flops_utilisation(flops_per_sample: float, samples_per_s_per_device: float, peak: float) -> float:
    """The share of the device's peak FLOP/s the model's FLOPs reach: achieved FLOP/s per device over the peak."""
    return flops_per_sample * samples_per_s_per_device / peak


class StepClock:
    """Marks points of a loop step: CUDA events recorded on the current stream on a CUDA device (no host
    synchronisation), ``time.perf_counter()`` elsewhere. :func:`seconds` reads the time between two marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def seconds(start: Mark, end: Mark) -> float:
    """Seconds from ``start`` to ``end`` (two marks of one :class:`StepClock`). On CUDA this waits until the device
    reached ``end``: read marks once per log interval, never in a step."""
    if isinstance(start, float):
        return end - start  # type: ignore[operator]
    end.synchronize()  # type: ignore[union-attr]
    return start.elapsed_time(end) / 1000.0


class PhaseTimes:
    """One rank's loop-step phases over a log interval: the data wait per step (host seconds) and each step's
    marks (start, forward begins, update ends) from :meth:`lerobot_mg.step.Stepper.step`, read at :meth:`take`."""

    def __init__(self) -> None:
        self._data_wait_s = 0.0
        self._marks: list[Sequence[Mark]] = []

    def add(self, data_wait_s: float, marks: Sequence[Mark] | None) -> None:
        self._data_wait_s += data_wait_s
        if marks is not None:
            self._marks.append(marks)

    def take(self, num_steps: int) -> dict[str, float]:
        """The mean seconds per loop step of each phase over ``num_steps`` steps (``dataloading_s``,
        ``preprocessing_s``, ``update_s``); starts the next interval. On CUDA it waits for the last step's end."""
        steps = max(num_steps, 1)
        if self._marks:  # the last end first: every earlier event on the stream is complete then
            seconds(self._marks[-1][0], self._marks[-1][-1])
        out = {"dataloading_s": self._data_wait_s / steps,
               "preprocessing_s": sum(seconds(m[0], m[1]) for m in self._marks) / steps,
               "update_s": sum(seconds(m[1], m[2]) for m in self._marks) / steps}
        self._data_wait_s, self._marks = 0.0, []
        return out


PHASE_KEYS = ("dataloading_s", "preprocessing_s", "update_s")
