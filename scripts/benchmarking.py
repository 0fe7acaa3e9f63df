"""What the benchmark scripts (scripts/bench_*.py) share: figures printed with their goal beside them and
written to ``outputs/bench/<script>.json`` as a list of ``{name, value, goal, unit, goal_is}`` records (``goal`` a
bound the value is meant to stay within, ``goal_is`` which side: ``at_most`` or ``at_least``; both null for a
figure reported without a goal), and a launcher for measurements on 2 gloo ranks."""

from __future__ import annotations

import gc
import json
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

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


def report(bench: str, results: list[BenchResult], directory: Path = BENCH_DIR) -> Path:
    """Print every result with its goal and write them all to ``<directory>/<bench>.json``."""
    for result in results:
        print(result.line(), flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{bench}.json"
    path.write_text(json.dumps([asdict(result) for result in results], indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def _run_then_release(worker: Callable[..., None], *args: Any) -> None:
    # The worker's model (DDP's C++ reducer) must be freed while the process groups live: a reducer that drops
    # the last reference to a gloo group can deadlock the exit (see lerobot_mg/launch/run_state.py).
    worker(*args)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_on_ranks(worker: Callable[..., None], args: tuple[Any, ...], world_size: int = 2,
                 timeout: float = 1800) -> Any:
    """Spawn ``worker(rank, world_size, port, *args, queue)`` on every rank and return what rank 0 puts in the
    queue (the worker sets up its own process group from the port)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [context.Process(target=_run_then_release, args=(worker, rank, world_size, port, *args, queue))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    result = queue.get(timeout=timeout)
    for process in processes:
        process.join(timeout=120)
    return result
