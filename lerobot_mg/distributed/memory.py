"""Bytes each rank holds for training: its parameter shards, their gradients and its optimizer state."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _local_bytes(tensor: Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's parameter bytes (frozen and trainable), gradient bytes (one per trainable element, in the
    parameter's dtype, as backward allocates them) and optimizer-state bytes (after the first update)."""
    params = list(model.parameters())
    held = {
        "parameters": sum(_local_bytes(p) for p in params),
        "trainable_parameters": sum(_local_bytes(p) for p in params if p.requires_grad),
        "optimizer_state": 0,
    }
    if optimizer is not None:
        held["optimizer_state"] = sum(
            _local_bytes(value) for state in optimizer.state.values() for value in state.values()
            if isinstance(value, Tensor)
        )
    held["gradients"] = held["trainable_parameters"]
    held["total"] = held["parameters"] + held["gradients"] + held["optimizer_state"]
    return held


def gather_rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
    """:func:`rank_bytes` of every rank, in rank order. Collective: every rank must call it."""
    mine = rank_bytes(model, optimizer)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered
