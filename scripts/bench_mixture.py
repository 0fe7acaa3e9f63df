"""Benchmark: a mixture of 10 LeRobot datasets, 20M frames in all (``dataset=mixture``,
``lerobot_mg.data.mixture``), against the single-dataset reader on the same frames.

    python scripts/bench_mixture.py                         # 10 sources, 20M frames in all
    python scripts/bench_mixture.py --frames 2000000 --dir /scratch/bench

Ten LeRobot v3.0 state datasets of 2M frames each are generated with ``scripts/synthetic_dataset.py`` (once: they
are kept under ``outputs/bench/bench_mixture/``, 2.4 GB): half from a 14-dimensional robot at 50 fps, half from a
7-dimensional one at 30 fps, episodes of 100 to 190 frames (the shorter the episodes, the more per-episode
metadata a reader holds). The mixture of all ten, opened as a run of pi0 opens it (each source drawn by its share of
frames, the shorter state and action padded, a 50-step action chunk per item at each source's own fps), is built
once into a fresh dataset cache (timed: ``cache_build_s``; the cache is removed at the end), then opened by 2 ranks
(processes on one gloo group) as a run opens it: the mixture, its sampler and the sampler's epoch order (drawn by
one rank into the cache, mapped by the other), then batches of 32 read by 2 DataLoader workers each. Each rank
measures, in ``/proc/<pid>/smaps_rollup``:

- the time to open the mixture once the cache exists, per source (goal: at most 2 s);
- its private memory (``Private_Clean + Private_Dirty``, what the rank holds by itself: not the memory-mapped
  cache, which a node's ranks share) after reading its batches, above the same process before it opened anything
  (goal: at most 100 MiB), and the parts of it the opened mixture and the epoch order hold, in the rank that drew
  the order and in the one that mapped it.

Then one process reads the same random frames, in the sampler's order, in batches of 32 through the mixture (its
items, then its collate: padding, masks, global indices) and through the sources' own ``LeRobotDataset`` readers
(each frame from its source, each source's frames of a batch collated together as a single-dataset run collates
them), in alternating rounds; the median over rounds of the mixture's items per second of CPU time over the
readers' is the mixture's speed (goal: at least 0.9). The items/s of the 2 ranks x 2 workers and the workers' private memory are
reported without a goal (see ``scripts/bench_dataset_memory.py`` for what a worker's private pages are).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from benchmarking import BENCH_DIR, BenchResult, GoalIs, private_memory, read_batches, report, run_on_ranks
from synthetic_dataset import write_state_dataset

from lerobot_mg.config.choices import DatasetName
from lerobot_mg.config.pi0 import PI0Config
from lerobot_mg.config.schema import DatasetConfig, SourceConfig
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.data.mixture import MixtureDataset, MixtureSampler, plan_mixture
from lerobot_mg.policies.base import delta_timestamps

FRAMES = 20_000_000
SOURCES = 10
BATCH_SIZE = 32
CHUNK = 50  # action steps per item, at each source's fps
MIB = 2**20
KEYS = ("observation.state", "action")
ROBOTS = ((14, 50), (7, 30))  # (state and action dimension, fps), alternating over the sources


@dataclass(frozen=True)
class SourceSpec:
    """One generated source: its frames, its robot and its episodes (``seed`` makes its values its own, so that no
    two sources are the same dataset)."""

    frames: int
    dim: int
    fps: int
    episode_length: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.frames}f-{self.dim}d-{self.fps}fps-{self.episode_length}e-s{self.seed}"


def source_specs(frames: int, sources: int) -> list[SourceSpec]:
    """``sources`` datasets of ``frames`` frames in all (the last one takes the remainder)."""
    share = frames // sources
    return [SourceSpec(share if i < sources - 1 else frames - share * (sources - 1), *ROBOTS[i % len(ROBOTS)],
                       episode_length=100 + 10 * i, seed=i) for i in range(sources)]


def generate(directory: Path, specs: list[SourceSpec]) -> list[Path]:
    """The sources' roots under ``directory``, each written unless an earlier run wrote it (its info.json, written
    last, marks it complete)."""
    roots = []
    for spec in specs:
        root = directory / spec.name
        if not (root / "meta" / "info.json").is_file():
            shutil.rmtree(root, ignore_errors=True)
            start = time.perf_counter()
            write_state_dataset(root, spec.frames, dim=spec.dim, episode_length=spec.episode_length, num_files=4,
                                fps=spec.fps, seed=spec.seed)
            print(f"{root.name}: {spec.frames:,} frames generated in {time.perf_counter() - start:.1f} s", flush=True)
        roots.append(root)
    return roots


def _open_mixture(roots: list[Path]) -> MixtureDataset:
    """The mixture of ``roots`` as a run opens it for pi0 (a policy that pads the shorter sources' state and action):
    each source's metadata, the mixture's plan, then each source's reader of the state and a 50-step action chunk at
    its own fps; every source drawn by its share of frames."""
    policy = PI0Config(chunk_size=CHUNK)
    metas = [DatasetMeta.read(root) for root in roots]
    sources = [SourceConfig(root=str(root)) for root in roots]
    plan = plan_mixture(DatasetConfig(name=DatasetName.mixture, sources=sources), metas, policy)
    return MixtureDataset(plan, functools.partial(delta_timestamps, policy, plan.features), KEYS)


def _sampler(mixture: MixtureDataset, rank: int, world_size: int) -> MixtureSampler:
    return MixtureSampler(mixture, BATCH_SIZE, seed=0, rank=rank, world_size=world_size)


def _rank(rank: int, world_size: int, port: int, roots: list[Path], batches: int) -> list[dict[str, float]]:
    base = private_memory()  # after the imports of this module: torch, the configs, the mixture's code

    def above_base(memory: dict[str, int]) -> dict[str, int]:
        return {name: memory[name] - base[name] for name in base}

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.barrier()  # both ranks open together, as a run's ranks do
    start = time.perf_counter()
    mixture = _open_mixture(roots)
    open_s = time.perf_counter() - start
    opened = above_base(private_memory())
    start = time.perf_counter()
    sampler = _sampler(mixture, rank, world_size)
    sampler.permutation(0)  # one rank of the machine draws it into the cache, the others wait, then map it
    order_s = time.perf_counter() - start
    ordered = above_base(private_memory())
    loader = torch.utils.data.DataLoader(mixture, batch_sampler=sampler, num_workers=2, persistent_workers=True,
                                         collate_fn=mixture.collate)  # as the run's loader (lerobot_mg.data.loader)
    items_per_s, rank_memory, workers = read_batches(loader, batches, BATCH_SIZE)
    read = above_base(rank_memory)
    record = {"open_s": open_s, "order_s": order_s, "items_per_s": items_per_s, "opened": opened, "ordered": ordered,
              "read": read, "worker_dirty": max(worker["Private_Dirty"] for worker in workers),
              "worker_clean": max(worker["Private_Clean"] for worker in workers)}
    del loader
    records = [None] * world_size
    dist.all_gather_object(records, record)
    dist.destroy_process_group()
    return records


def _total(memory: dict[str, int]) -> int:
    return memory["Private_Clean"] + memory["Private_Dirty"]


def reader_frames(mixture: MixtureDataset, indices: list[int]) -> list[tuple[LeRobotDataset, int]]:
    """Where each global index of the mixture is in its source: (the source's reader, the index in it)."""
    sources = np.searchsorted(mixture.offsets, indices, side="right") - 1
    return [(mixture.datasets[s], index - int(mixture.offsets[s])) for s, index in zip(sources.tolist(), indices)]


def _through_reader(frame: tuple[LeRobotDataset, int]) -> None:
    dataset, index = frame
    dataset[index]


def _items_per_cpu_s(read: Callable[[Any], Any], units: list, num_items: int) -> float:
    """``num_items`` per CPU-second of ``read`` over ``units`` (frames, or batches of them)."""
    gc.collect()
    start = time.process_time()
    for unit in units:
        read(unit)
    return num_items / (time.process_time() - start)


def _through_readers(batch: list[tuple[LeRobotDataset, int]]) -> None:
    """A batch read by the sources' own readers and collated as a single-dataset run collates its batches: each
    source's items of the batch stacked together (items of different robots cannot share one stack)."""
    by_source: dict[int, list[Any]] = {}
    for dataset, index in batch:
        by_source.setdefault(id(dataset), []).append(dataset[index])
    for items in by_source.values():
        torch.utils.data.default_collate(items)


def _through_mixture(mixture: MixtureDataset) -> Callable[[list[int]], Any]:
    """A batch read as the run's DataLoader reads it: its items, then the mixture's collate (padding, masks)."""
    return lambda batch: mixture.collate([mixture[index] for index in batch])


def compare_speed(mixture: MixtureDataset, rounds: int, items: int) -> dict[str, float]:
    """Random items per second of CPU time, of the mixture (in batches of 32 through its collate, which pads and marks
    them, as the run's DataLoader reads them) and of its sources' own readers on the same frames (each source's items
    of a batch collated together, as a single-dataset run collates them):
    ``rounds`` blocks of ``items`` consecutive positions of the sampler's epoch order (random frames across the
    sources), each block read once untimed (its pages mapped), then timed through both, the first reader
    alternating; the medians over the rounds. CPU time (one thread) rather than wall time: a machine shared with other
    work slows both alike only on average, while their CPU time per item is what an idle core would spend."""
    order = _sampler(mixture, 0, 1).permutation(0).numpy()
    ratios, mixture_rates, reader_rates = [], [], []
    for block in range(rounds):
        indices = order[block * items:(block + 1) * items].tolist()
        frames = reader_frames(mixture, indices)
        batches = [indices[start:start + BATCH_SIZE] for start in range(0, len(indices), BATCH_SIZE)]
        frame_batches = [frames[start:start + BATCH_SIZE] for start in range(0, len(frames), BATCH_SIZE)]
        _items_per_cpu_s(_through_reader, frames, len(frames))
        if block % 2:
            reader_rate = _items_per_cpu_s(_through_readers, frame_batches, len(frames))
            mixture_rate = _items_per_cpu_s(_through_mixture(mixture), batches, len(indices))
        else:
            mixture_rate = _items_per_cpu_s(_through_mixture(mixture), batches, len(indices))
            reader_rate = _items_per_cpu_s(_through_readers, frame_batches, len(frames))
        ratios.append(mixture_rate / reader_rate)
        mixture_rates.append(mixture_rate)
        reader_rates.append(reader_rate)
    return {"ratio": statistics.median(ratios), "mixture": statistics.median(mixture_rates),
            "readers": statistics.median(reader_rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=FRAMES, help="frames of all the sources together")
    parser.add_argument("--sources", type=int, default=SOURCES)
    parser.add_argument("--batches", type=int, default=200, help="batches of 32 each rank reads")
    parser.add_argument("--rounds", type=int, default=21, help="alternating rounds of the speed comparison")
    parser.add_argument("--items", type=int, default=2000, help="items each reader reads per round")
    parser.add_argument("--dir", type=Path, default=BENCH_DIR / "bench_mixture",
                        help="where the sources are generated and kept (default: outputs/bench/bench_mixture)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.dir.mkdir(parents=True, exist_ok=True)
    roots = generate(args.dir, source_specs(args.frames, args.sources))
    # A fresh dataset cache each run (the first open builds it: timed), removed at the end; the ranks, spawned,
    # inherit its location.
    cache_dir = Path(tempfile.mkdtemp(prefix="cache-", dir=args.dir))
    os.environ["LEROBOT_MG_DATASET_CACHE"] = str(cache_dir)
    try:
        start = time.perf_counter()
        mixture = _open_mixture(roots)
        build_s = time.perf_counter() - start
        records = run_on_ranks(_rank, (roots, args.batches), world_size=2)
        speed = compare_speed(mixture, args.rounds, args.items)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    frames = len(mixture)
    per_source = max(r["open_s"] for r in records) / len(roots)
    stages = (("opened", "mixture opened"), ("ordered", "epoch order drawn or mapped"),
              ("read", f"{args.batches} batches read"))
    for rank, record in enumerate(records):
        memory = ", ".join(f"{what} {record[stage]['Private_Clean'] / MIB:.1f} + "
                           f"{record[stage]['Private_Dirty'] / MIB:.1f}" for stage, what in stages)
        print(f"rank {rank}: private MiB (clean + dirty) above its imports: {memory}", flush=True)
    print(f"{len(roots)} sources, {frames:,} frames; mixture {speed['mixture']:,.0f} items per CPU second, its "
          f"sources' readers {speed['readers']:,.0f} (medians over {args.rounds} rounds of {args.items} items)",
          flush=True)
    order_growth = [_total(r["ordered"]) - _total(r["opened"]) for r in records]
    report("bench_mixture", [
        BenchResult("open_s_per_source_with_cache", round(per_source, 3), 2, "s"),
        BenchResult("rank_private_mib", round(max(_total(r["read"]) for r in records) / MIB, 1), 100, "MiB"),
        BenchResult("mixture_over_single_dataset_random_items_per_s", round(speed["ratio"], 3), 0.9, "x",
                    GoalIs.AT_LEAST),
        BenchResult("rank_private_mib_mixture_opened", round(max(_total(r["opened"]) for r in records) / MIB, 1),
                    None, "MiB"),
        BenchResult("rank_private_mib_epoch_order_drawn", round(max(order_growth) / MIB, 1), None, "MiB"),
        BenchResult("rank_private_mib_epoch_order_mapped", round(min(order_growth) / MIB, 1), None, "MiB"),
        BenchResult("epoch_order_s", round(max(r["order_s"] for r in records), 3), None, "s"),
        BenchResult("mixture_random_items_per_cpu_s", round(speed["mixture"]), None, "items/s"),
        BenchResult("single_dataset_random_items_per_cpu_s", round(speed["readers"]), None, "items/s"),
        BenchResult("mixture_random_items_per_s_2_ranks_x_2_workers", round(sum(r["items_per_s"] for r in records)),
                    None, "items/s"),
        BenchResult("cache_build_s", round(build_s, 2), None, "s"),
        BenchResult("worker_private_dirty_mib", round(max(r["worker_dirty"] for r in records) / MIB, 1), None, "MiB"),
        BenchResult("worker_private_clean_mapped_mib", round(max(r["worker_clean"] for r in records) / MIB, 1), None,
                    "MiB"),
        BenchResult("sources", len(roots), None, "datasets"),
        BenchResult("frames_measured", frames, None, "frames"),
    ], BENCH_DIR)


if __name__ == "__main__":
    main()
