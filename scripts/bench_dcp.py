"""Benchmark: checkpoint I/O. DCP save and load of model + optimizer against a plain write/read of the same bytes,
and how long an asynchronous save blocks training against a synchronous save of the same state.

    python scripts/bench_dcp.py                      # ~128 MB of fp32 weights + AdamW state (~384 MB in all)
    python scripts/bench_dcp.py --size-mb 512 --repeats 5 --dir /scratch/bench

One process, CPU, no process group: the DCP cost measured is its own (planning, metadata, file layout), not
communication. The plain baseline writes the same tensors' bytes to one file with one fsync (DCP fsyncs its
files too) and reads them back into preallocated buffers. Loads are timed with three readers of the same files:
torch's ``FileSystemReader`` (reference), lerobot_mg's ``InPlaceFileSystemReader`` (what resumes use), and, for the
format question, torch's safetensors-backed DCP storage (``HuggingFaceStorageWriter/Reader``, its own files).
The async figure runs ``CheckpointManager.save`` itself (the 1-process safetensors layout) with and without
``async_save``: the time save() holds the caller, and the host memory the staged copy takes.

Figures (outputs/bench/bench_dcp.json): dcp_save_over_plain_write, dcp_load_over_raw_read (goal <= 1.5),
torch_reader_load_over_raw_read, hf_safetensors_load_over_raw_read, async_save_blocked_over_sync (goal <= 0.25),
async_save_staged_mib, checkpoint_mib, sync_save_s.
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
from benchmarking import BenchResult, GoalIs, report
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.dcp_io import InPlaceFileSystemReader
from lerobot_mg.checkpoint.manager import CheckpointManager, SaveItems
from lerobot_mg.distributed.parallel_dims import ParallelDims

_WIDTH = 2048  # one Linear(2048, 2048) is 16 MiB of fp32 weights


class _Weights(nn.Sequential):
    """A stack of Linear layers with the one method CheckpointManager needs from a policy to write its weights."""

    def save_pretrained(self, directory: Path, state_dict: dict[str, torch.Tensor]) -> None:
        save_file(state_dict, str(Path(directory) / "model.safetensors"))


def build(size_mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    num_layers = max(1, size_mb // 16)
    model = _Weights(*(nn.Linear(_WIDTH, _WIDTH) for _ in range(num_layers)))
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


def zero(state: dict) -> None:
    for tensor in flat_tensors(state):
        tensor.zero_()


def check_equal(loaded: dict, original: list[torch.Tensor], what: str) -> None:
    for got, want in zip(flat_tensors(loaded), original, strict=True):
        if not torch.equal(got, want):
            raise AssertionError(f"{what}: loaded tensors differ from the saved ones")


def hf_safetensors_load(state: dict, target: dict, directory: Path, repeats: int) -> float | None:
    """Median load time through torch's safetensors-backed DCP storage (flat tensor keys only), or None where this
    torch cannot write a state of this shape with it."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    flat = {f"t{i}": tensor for i, tensor in enumerate(flat_tensors(state))}  # it stores flat name -> tensor
    flat_target = {f"t{i}": tensor for i, tensor in enumerate(flat_tensors(target))}
    try:
        dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(directory)), no_dist=True)
    except Exception as error:  # noqa: BLE001 - a figure this torch cannot give is reported, not fatal
        print(f"hf safetensors DCP storage: save failed ({type(error).__name__}: {error}); figure skipped")
        return None
    seconds = timed(lambda: dcp.load(flat_target, storage_reader=HuggingFaceStorageReader(str(directory)),
                                     no_dist=True), repeats, lambda: zero(target))
    check_equal(target, flat_tensors(state), "hf safetensors storage")
    return seconds


def async_blocked(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path, repeats: int
                  ) -> tuple[float, float, int, int]:
    """(median seconds save() blocks with async_save, median seconds of a synchronous save, the bytes the staged
    copy holds (the model and optimizer tensors save() copies), the bytes of the last checkpoint on disk)."""
    dims = ParallelDims.resolve(1, 1, 1, 0, 0)
    items = SaveItems(model, None, None, None, None, {"bench": True})
    results = {}
    for async_save in (False, True):
        manager = CheckpointManager(root / f"async_{async_save}", "safetensors", keep_last=1, dims=dims,
                                    async_save=async_save)
        times = []
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            manager.save(step, model, optimizer, items, {"step": step})
            times.append(time.perf_counter() - start)
            manager.wait()  # outside the timing: the next save starts with nothing in flight
        manager.close()
        results[async_save] = statistics.median(times)
    last = L.checkpoints_root(root / "async_True") / L.LAST_LINK
    checkpoint_bytes = sum(path.stat().st_size for path in last.resolve().rglob("*") if path.is_file())
    staged_bytes = sum(tensor.numel() * tensor.element_size()
                       for tensor in flat_tensors(state_tensors(model, optimizer)))
    return results[True], results[False], staged_bytes, checkpoint_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=128, help="fp32 weights, MB (optimizer state is 2x this)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")

    model, optimizer = build(args.size_mb)
    state = state_tensors(model, optimizer)
    tensors = flat_tensors(state)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]
    target = state_tensors(*build(args.size_mb))  # DCP loads in place into a state dict of the same structure

    root = Path(tempfile.mkdtemp(dir=args.dir))
    dcp_dir, plain_file = root / "dcp", root / "plain.bin"
    try:
        dcp_save = timed(lambda: dcp.save(state, checkpoint_id=dcp_dir, no_dist=True), args.repeats,
                         lambda: shutil.rmtree(dcp_dir, ignore_errors=True))
        plain_save_s = timed(lambda: plain_save(tensors, plain_file), args.repeats, lambda: plain_file.unlink(True))
        plain_load_s = timed(lambda: plain_load(buffers, plain_file), args.repeats, lambda: None)
        torch_load = timed(lambda: dcp.load(target, storage_reader=FileSystemReader(dcp_dir), no_dist=True),
                           args.repeats, lambda: zero(target))
        check_equal(target, tensors, "torch FileSystemReader")
        inplace_load = timed(lambda: dcp.load(target, storage_reader=InPlaceFileSystemReader(dcp_dir), no_dist=True),
                             args.repeats, lambda: zero(target))
        check_equal(target, tensors, "InPlaceFileSystemReader")
        hf_load = hf_safetensors_load(state, target, root / "hf", args.repeats)
        blocked, sync_s, staged_bytes, checkpoint_bytes = async_blocked(model, optimizer, root / "manager", args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"model + AdamW state: {len(tensors)} tensors, {num_bytes / 2**30:.2f} GiB; median of {args.repeats} runs; "
          f"plain write {plain_save_s:.3f} s, plain read {plain_load_s:.3f} s")
    results = [
        BenchResult("dcp_save_over_plain_write", dcp_save / plain_save_s, 1.5, "x"),
        BenchResult("dcp_load_over_raw_read", inplace_load / plain_load_s, 1.5, "x"),
        BenchResult("torch_reader_load_over_raw_read", torch_load / plain_load_s, None, "x"),
    ]
    if hf_load is not None:
        results.append(BenchResult("hf_safetensors_load_over_raw_read", hf_load / plain_load_s, None, "x"))
    results += [
        BenchResult("async_save_blocked_over_sync", blocked / sync_s, 0.25, "x", GoalIs.AT_MOST),
        BenchResult("async_save_staged_mib", staged_bytes / 2**20, None, "MiB"),
        BenchResult("checkpoint_mib", checkpoint_bytes / 2**20, None, "MiB"),
        BenchResult("sync_save_s", sync_s, None, "s"),
    ]
    report("bench_dcp", results)


if __name__ == "__main__":
    main()
