"""What the benchmark scripts (scripts/bench_*.py) share: figures printed with their goal beside them and
written to ``outputs/bench/<script>.json`` as ``{"machine": {...}, "results": [...]}``: the machine the figures were
measured on (CPU model, usable cores, memory, GPU, operating system, Python, torch and accelerate versions) and a
list of ``{name, value, goal, unit, goal_is}`` records (``goal`` a bound the value is meant to stay within,
``goal_is`` which side: ``at_most`` or ``at_least``; both null for a figure reported without a goal); a launcher
for measurements on 2 gloo ranks; and a process's private memory."""

from __future__ import annotations

import gc
import json
import os
import pickle
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from importlib.metadata import version
from pathlib import Path
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lerobot_mg.config.schema import REPO_ROOT

BENCH_DIR = REPO_ROOT / "outputs" / "bench"


class GoalIs(str, Enum):
    """Which side of its goal a figure is meant to stay on (a str so that it writes to JSON as its value)."""

    AT_MOST = "at_most"  # a cost: time, bytes, a slowdown ratio
    AT_LEAST = "at_least"  # a speed: samples/s, a speed-up ratio

    def met(self, value: float, goal: float) -> bool:
        return value <= goal if self is GoalIs.AT_MOST else value >= goal

    @property
    def symbol(self) -> str:
        return "<=" if self is GoalIs.AT_MOST else ">="


@dataclass(frozen=True)
class BenchResult:
    name: str
    value: float
    goal: float | None  # None: reported without a goal
    unit: str
    goal_is: GoalIs | None = GoalIs.AT_MOST  # ignored (written as null) without a goal

    def __post_init__(self) -> None:
        # A figure computed from tensors (a loss, a norm) is a 0-d tensor until converted: JSON takes a float.
        object.__setattr__(self, "value", float(self.value))
        if self.goal is None:
            object.__setattr__(self, "goal_is", None)

    def met(self) -> bool | None:
        return None if self.goal is None or self.goal_is is None else self.goal_is.met(self.value, self.goal)

    def line(self) -> str:
        value = f"{int(self.value):,}" if float(self.value).is_integer() else f"{self.value:.4g}"
        met = self.met()
        verdict = "" if met is None else (
            f"  (goal {self.goal_is.symbol} {self.goal:g}: {'met' if met else 'NOT met'})"  # type: ignore[union-attr]
        )
        return f"{self.name} = {value} {self.unit}{verdict}"


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine figures are measured on, as docs/benchmarks.md shows it beside them."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "gpus": gpus,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": version("accelerate"),
    }


def report(bench: str, results: list[BenchResult], directory: Path = BENCH_DIR) -> Path:
    """Print every result with its goal and write them all, with the machine, to ``<directory>/<bench>.json``."""
    for result in results:
        print(result.line(), flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{bench}.json"
    document = {"machine": machine(), "results": [asdict(result) for result in results]}
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def private_memory(pid: int | str = "self") -> dict[str, int]:
    """Bytes of ``pid``'s memory no other process maps (``Private_Clean``, ``Private_Dirty`` of
    ``/proc/<pid>/smaps_rollup``): what the process costs the machine by itself, unlike RSS, which also counts the
    pages it shares (a memory-mapped dataset cache, the libraries)."""
    with open(f"/proc/{pid}/smaps_rollup") as lines:
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {name: 1024 * int(fields[name].split()[0]) for name in ("Private_Clean", "Private_Dirty")}


def read_batches(loader: Any, batches: int, batch_size: int) -> tuple[float, dict[str, int], list[dict[str, int]]]:
    """Start ``loader``'s workers, wait for every rank (a gloo group), then read ``batches`` batches as a run does:
    (items per second of this rank, its private memory then, each worker's). The workers stop on return."""
    iterator = iter(loader)
    next(iterator)  # the workers have started
    dist.barrier()
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    items_per_s = batches * batch_size / (time.perf_counter() - start)
    return items_per_s, private_memory(), [private_memory(worker.pid) for worker in iterator._workers]


def _run_then_release(worker: Callable[..., Any], rank: int, world_size: int, port: int, *args: Any) -> None:
    *worker_args, queue = args
    result = worker(rank, world_size, port, *worker_args)
    # The worker's model (DDP's C++ reducer) must be freed while the process groups live: a reducer that drops
    # the last reference to a gloo group can deadlock the exit (see lerobot_mg/launch/run_state.py).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        # As bytes, pickled by value: torch's multiprocessing pickler would send a tensor as a handle to this
        # process's shared memory, gone once the process exits, before the parent may have read it.
        queue.put(pickle.dumps(result))


def run_on_ranks(worker: Callable[..., Any], args: tuple[Any, ...], world_size: int = 2,
                 timeout: float = 1800) -> Any:
    """Spawn ``worker(rank, world_size, port, *args)`` on every rank and return what it returned on rank 0 (any
    picklable value; tensors come back by value). The worker sets up its own process group from the port."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [context.Process(target=_run_then_release, args=(worker, rank, world_size, port, *args, queue))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = pickle.loads(queue.get(timeout=1))
            break
        except Empty:
            failed = [process.exitcode for process in processes if process.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for process in processes:
                    process.kill()
                raise RuntimeError(f"benchmark ranks: exit codes {[p.exitcode for p in processes]}, no result "
                                   f"within {timeout:.0f} s" if not failed else
                                   f"a benchmark rank failed (exit codes {[p.exitcode for p in processes]}): its "
                                   "traceback is above") from None
    for process in processes:
        process.join(timeout=120)
    return result
