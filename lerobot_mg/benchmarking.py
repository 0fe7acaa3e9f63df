"""What the benchmark scripts share: figures printed with their goal beside them and written to
``outputs/bench/<script>.json`` as a list of ``{name, value, goal, unit}`` records (``goal`` an upper bound, as
scripts/bench_peft.py writes them, or null for a figure reported without one), and a launcher for measurements on
2 gloo ranks."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from lerobot_mg.config.schema import REPO_ROOT

BENCH_DIR = REPO_ROOT / "outputs" / "bench"


@dataclass(frozen=True)
class BenchResult:
    name: str
    value: float
    goal: float | None  # the value is meant to stay at or below it; None: reported without a goal
    unit: str

    def line(self) -> str:
        value = f"{int(self.value):,}" if float(self.value).is_integer() else f"{self.value:.4g}"
        verdict = "" if self.goal is None else (
            f"  (goal <= {self.goal:g}: {'met' if self.value <= self.goal else 'NOT met'})"
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


def run_on_ranks(worker: Callable[..., None], args: tuple[Any, ...], world_size: int = 2,
                 timeout: float = 1800) -> Any:
    """Spawn ``worker(rank, world_size, port, *args, queue)`` on every rank and return what rank 0 puts in the
    queue (the worker sets up its own process group from the port)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [context.Process(target=worker, args=(rank, world_size, port, *args, queue))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    result = queue.get(timeout=timeout)
    for process in processes:
        process.join(timeout=120)
    return result
