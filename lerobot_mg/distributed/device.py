"""What this machine's device can do, asked before any process group exists: CPU or GPU, the precisions its
arithmetic has, whether torch.compile's backend is installed."""

from __future__ import annotations

import shutil

import torch
from torch.utils._triton import has_triton

from lerobot_mg.config.schema import AcceleratorConfig


def use_cpu(acc_cfg: AcceleratorConfig) -> bool:
    """The run trains on the CPU: asked for (``accelerator.cpu``), or no GPU is visible."""
    return acc_cfg.cpu or not torch.cuda.is_available()


def precision_unsupported(mixed_precision: str, use_cpu: bool) -> tuple[str, str] | None:
    """(why this device cannot compute in ``mixed_precision``, the setting it can) or None when it can.

    A GPU that lacks the arithmetic would otherwise fail deep in the first forward (fp16 before compute capability
    5.3) or, for bf16 before 8.0, run torch's slow emulation without saying so.
    """
    if mixed_precision == "no":
        return None
    device = "cpu" if use_cpu else "cuda"
    if not torch.amp.is_autocast_available(device):
        return f"this torch build has no autocast for {device}", "accelerator.mixed_precision=no"
    if use_cpu:  # CPU autocast computes in both (fp16 with the loss scaler distributed/accelerator.py builds)
        return None
    capability = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]})"
    has_fp16 = capability >= (5, 3)
    if mixed_precision == "fp16" and not has_fp16:
        return f"{gpu} has no fp16 arithmetic (compute capability 5.3 or later)", "accelerator.mixed_precision=no"
    if mixed_precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return (f"{gpu} has no native bf16 (compute capability 8.0 or later); torch would emulate it slowly",
                f"accelerator.mixed_precision={'fp16' if has_fp16 else 'no'}")
    return None


def compile_unavailable_reason(use_cpu: bool) -> str | None:
    """Why torch.compile cannot run here (its inductor backend needs a C++ compiler on the CPU, Triton on a GPU),
    or None when it can."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (TorchDynamo) does not support this Python version or platform"
    if use_cpu:
        compiler = torch._inductor.config.cpp.cxx[-1] or "g++"
        if shutil.which(compiler) is None:
            return f"torch.compile's CPU backend (inductor) needs a C++ compiler, and {compiler!r} is not on PATH"
        return None
    if not has_triton():
        return "torch.compile's GPU backend (inductor) needs Triton, which is not installed"
    return None
