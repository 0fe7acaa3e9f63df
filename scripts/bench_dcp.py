"""Benchmark: saving and loading model + optimizer as DCP vs a plain write/read of the same bytes.

    python scripts/bench_dcp.py                      # ~256 MB of fp32 weights + AdamW state (~768 MB in all)
    python scripts/bench_dcp.py --size-mb 512 --repeats 5 --dir /scratch/bench

One process, CPU, no process group: the DCP cost measured is its own (planning, metadata, file layout), not
communication. The plain baseline writes the same tensors' bytes to one file with one fsync (DCP fsyncs its
files too) and reads them back into preallocated buffers. The goal is a DCP/plain ratio of at most 1.5.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

_WIDTH = 2048  # one Linear(2048, 2048) is 16 MiB of fp32 weights


def build(size_mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    num_layers = max(1, size_mb // 16)
    model = nn.Sequential(*(nn.Linear(_WIDTH, _WIDTH) for _ in range(num_layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():  # one step gives AdamW its two moments per parameter
        param.grad = torch.randn_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def flat_tensors(state: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def walk(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(state)
    return found


def plain_save(tensors: list[torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        for tensor in tensors:
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def plain_load(buffers: list[torch.Tensor], path: Path) -> None:
    with open(path, "rb") as f:
        for buffer in buffers:
            f.readinto(buffer.reshape(-1).view(torch.uint8).numpy().data)


def timed(action: Callable[[], None], repeats: int, before_each: Callable[[], None]) -> float:
    """Median wall time of ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        before_each()
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256, help="fp32 weights, MB (optimizer state is 2x this)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    model, optimizer = build(args.size_mb)
    state = state_tensors(model, optimizer)
    tensors = flat_tensors(state)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]
    target = state_tensors(model, optimizer)  # DCP loads in place into a state dict of the same structure

    root = Path(tempfile.mkdtemp(dir=args.dir))
    dcp_dir, plain_file = root / "dcp", root / "plain.bin"

    def clear_dcp() -> None:
        shutil.rmtree(dcp_dir, ignore_errors=True)

    try:
        dcp_save = timed(lambda: dcp.save(state, checkpoint_id=dcp_dir, no_dist=True), args.repeats, clear_dcp)
        plain_save_s = timed(lambda: plain_save(tensors, plain_file), args.repeats, lambda: plain_file.unlink(True))
        dcp_load = timed(lambda: dcp.load(target, checkpoint_id=dcp_dir, no_dist=True), args.repeats, lambda: None)
        plain_load_s = timed(lambda: plain_load(buffers, plain_file), args.repeats, lambda: None)
        for loaded, original in zip(flat_tensors(target), tensors):
            assert torch.equal(loaded, original)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gib = num_bytes / 2**30
    print(f"model + AdamW state: {len(tensors)} tensors, {gib:.2f} GiB; median of {args.repeats} runs")
    print(f"{'':6}{'DCP s':>10}{'plain s':>10}{'DCP GiB/s':>12}{'plain GiB/s':>13}{'ratio':>8}")
    for name, dcp_s, plain_s in (("save", dcp_save, plain_save_s), ("load", dcp_load, plain_load_s)):
        ratio = dcp_s / plain_s
        verdict = "ok" if ratio <= 1.5 else "over the 1.5 goal"
        print(f"{name:6}{dcp_s:10.3f}{plain_s:10.3f}{gib / dcp_s:12.2f}{gib / plain_s:13.2f}{ratio:8.2f}  {verdict}")


if __name__ == "__main__":
    main()
