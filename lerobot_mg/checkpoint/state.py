"""Serialisation of the training state without pickle: optimizer state, RNG states, scheduler and scaler."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

# --- optimizer -------------------------------------------------------------------------------------------
# The optimizer state is keyed by parameter FQN (torch.distributed.checkpoint.state_dict's layout), so the
# same file loads into a plain, DDP or FSDP model: {"state": {fqn: {name: value}}, "param_groups": [...]}.

_SEP = "/"


def flatten_optimizer_state(osd: dict[str, Any]) -> tuple[dict[str, Tensor], list[dict[str, Any]]]:
    tensors: dict[str, Tensor] = {}
    for fqn, per_param in osd["state"].items():
        for name, value in per_param.items():
            tensor = value if isinstance(value, Tensor) else torch.tensor(value)
            tensors[f"state{_SEP}{fqn}{_SEP}{name}"] = tensor.detach().cpu().contiguous()
    return tensors, [dict(group) for group in osd["param_groups"]]


def unflatten_optimizer_state(tensors: dict[str, Tensor], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        _, fqn, name = key.split(_SEP)
        state.setdefault(fqn, {})[name] = tensor
    return {"state": state, "param_groups": param_groups}


# --- RNG -------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Tensor]:
    """This process's RNG states (python, numpy, torch CPU, CUDA) as tensors."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    assert np_name == "MT19937"
    state = {
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_meta": torch.tensor([py_version, 0 if py_gauss is None else 1], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if py_gauss is None else py_gauss], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_meta": torch.tensor([np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Tensor]) -> None:
    version, has_gauss = (int(v) for v in state["python_meta"])
    gauss = float(state["python_gauss"][0]) if has_gauss else None
    random.setstate((version, tuple(int(v) for v in state["python_state"]), gauss))
    pos, np_has_gauss = (int(v) for v in state["numpy_meta"])
    np.random.set_state(
        ("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, np_has_gauss, float(state["numpy_gauss"][0]))
    )
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def pack_rank_states(per_rank: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {f"rank{rank}{_SEP}{name}": t for rank, states in enumerate(per_rank) for name, t in states.items()}


def unpack_rank_states(tensors: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    per_rank: dict[int, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        rank, name = key.split(_SEP)
        per_rank.setdefault(int(rank.removeprefix("rank")), {})[name] = tensor
    return [per_rank[r] for r in sorted(per_rank)]


# --- small json files ------------------------------------------------------------------------------------


def write_json(path: Path, data: Any) -> None:
    """Write then fsync, so a file that exists is whole."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def scheduler_state_to_json(state: dict[str, Any]) -> dict[str, Any]:
    # LambdaLR stores `None` for plain-function lambdas; everything else is numbers and lists.
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


def scheduler_state_from_json(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "lr_lambdas": [None] * len(state["base_lrs"])}


def gather_rng_states(distributed: bool) -> list[dict[str, Tensor]]:
    """Every rank's RNG state, in rank order. Collective when ``distributed``."""
    mine = capture_rng_state()
    if not distributed:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def restore_rank_rng(per_rank: list[dict[str, Tensor]], rank: int, world_size: int) -> None:
    """This rank's RNG streams from a checkpoint's per-rank states.

    On the saved world size each rank restores its own stream exactly. On another one, ranks cannot inherit the
    streams one to one (after N -> 2N, ranks r and r + N would draw the same dropout): each rank seeds a stream of its
    own from the saved stream of rank r mod N and its rank, reproducible and distinct across ranks. The sampler
    decides the data order on its own (seed, epoch) either way.
    """
    if len(per_rank) == world_size:
        restore_rng_state(per_rank[rank])
    else:
        seed_rank_streams(per_rank[rank % len(per_rank)], rank)


def seed_rank_streams(saved: dict[str, torch.Tensor], rank: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) from a digest of a saved RNG state and ``rank``."""
    digest = hashlib.sha256(str(rank).encode())
    for name in sorted(saved):
        digest.update(name.encode())
        digest.update(saved[name].contiguous().view(torch.uint8).numpy().tobytes())
    seed = int.from_bytes(digest.digest()[:8], "little") >> 1
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    torch.manual_seed(seed)  # every CUDA device's generator too
