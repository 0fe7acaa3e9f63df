"""Benchmark: what a large dataset costs each rank, with the dataset cache (``lerobot_mg.data.cache``).

    python scripts/bench_dataset_memory.py                    # 5M frames (and 1.25M for the per-frame slope)
    python scripts/bench_dataset_memory.py --frames 1000000 --dir /scratch/bench

A LeRobot v3.0 state dataset (observation.state 14 + action 14 float32, 100-frame episodes, 4 data files) is
generated with ``scripts/synthetic_dataset.py``, opened once to build its cache (timed: ``cache_build_s``), then read
by 2 ranks (processes on one gloo group) with 2 DataLoader workers each, as a run reads it: a 50-frame action chunk
per item, batches of 32 from the resumable sampler (its permutation memory-mapped too). Each rank measures, in
``/proc/<pid>/smaps_rollup``:

- the private memory (``Private_Clean + Private_Dirty``: not RSS, which counts the pages shared with the other
  processes) of the rank, after it read its batches, above the same process after an empty import of
  ``lerobot_mg.data``;
- the time to open the dataset (metadata, checks, cache mapping, sampler) once the cache exists;
- random items/s of both ranks together.

Private memory is measured at ``frames`` and at ``frames / 4``: the difference gives the bytes per frame, and the
figure for 20M frames (the size of the large public robot datasets) is extrapolated from it. Goals: private memory
per rank for 20M frames <= 100 MiB above the empty import, open <= 2 s, items/s >= 10,000. The workers' private
memory is reported too (no goal): their dirty pages (mostly the rank's Python heap, copied on write after the fork
as Python touches its objects: a constant, not per frame; the per-frame slope is reported beside it), and the clean
column pages only that worker has mapped so far (page cache, which smaps counts as private until another process
maps the same page).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarking import BENCH_DIR, BenchResult, GoalIs, private_memory, read_batches, report

FRAMES_20M = 20_000_000
BATCH_SIZE = 32
CHUNK = 50
FPS = 50
MIB = 2**20


def _open(root: Path, rank: int, world_size: int):  # noqa: ANN202 (the dataset and sampler types are imported late)
    from lerobot_mg.data import LeRobotDataset, ResumableBatchSampler
    from lerobot_mg.data import sampler as sampler_module

    sampler_module.MAP_PERMUTATION_FROM = 0  # as for a dataset past the threshold, whatever --frames is
    dataset = LeRobotDataset(root, {"action": [k / FPS for k in range(CHUNK)]}, keys=["observation.state", "action"])
    sampler = ResumableBatchSampler(len(dataset), BATCH_SIZE, seed=0, rank=rank, world_size=world_size,
                                    cache_dir=dataset.cache_dir)
    sampler.permutation(0)
    return dataset, sampler


def _rank(rank: int, world_size: int, port: int, root: Path, batches: int) -> list[dict[str, float]]:
    import lerobot_mg.data  # noqa: F401 (the empty import the private memory is measured from)

    base = private_memory()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.barrier()  # both ranks open together, as a run's ranks do
    start = time.perf_counter()
    dataset, sampler = _open(root, rank, world_size)
    open_s = time.perf_counter() - start
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2, persistent_workers=True)
    items_per_s, rank_private, workers = read_batches(loader, batches, BATCH_SIZE)
    record = {"open_s": open_s, "items_per_s": items_per_s,
              "private": rank_private["Private_Clean"] + rank_private["Private_Dirty"] - base["Private_Clean"]
              - base["Private_Dirty"],
              "worker_dirty": max(worker["Private_Dirty"] for worker in workers),
              "worker_clean": max(worker["Private_Clean"] for worker in workers)}
    del loader
    records = [None] * world_size
    dist.all_gather_object(records, record)
    dist.destroy_process_group()
    return records


def _build_cache(root: Path) -> float:
    """Seconds to open the dataset the first time (building its cache), in a process of its own."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from bench_dataset_memory import _open; "
            "t = time.perf_counter(); _open(sys.argv[1], 0, 2); print(time.perf_counter() - t)")
    result = subprocess.run([sys.executable, "-c", code, str(root), str(Path(__file__).parent)], check=True,
                            capture_output=True, text=True)
    return float(result.stdout.split()[-1])


def measure(root: Path, frames: int, batches: int) -> dict[str, float]:
    from benchmarking import run_on_ranks
    from synthetic_dataset import write_state_dataset

    start = time.perf_counter()
    write_state_dataset(root, frames, dim=14, episode_length=100, num_files=4, fps=FPS)
    print(f"{frames:,} frames generated in {time.perf_counter() - start:.1f} s", flush=True)
    build_s = _build_cache(root)
    records = run_on_ranks(_rank, (root, batches), world_size=2)
    return {"frames": frames, "build_s": build_s,
            "open_s": max(r["open_s"] for r in records),
            "items_per_s": sum(r["items_per_s"] for r in records),
            "private": max(r["private"] for r in records),
            "worker_dirty": max(r["worker_dirty"] for r in records),
            "worker_clean": max(r["worker_clean"] for r in records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=5_000_000)
    parser.add_argument("--batches", type=int, default=300, help="batches of 32 each rank reads for items/s")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="bench_dataset_memory-", dir=args.dir))
    try:
        small = measure(work / "quarter", args.frames // 4, args.batches)
        shutil.rmtree(work / "quarter")
        large = measure(work / "full", args.frames, args.batches)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_frame = max(0.0, (large["private"] - small["private"]) / (large["frames"] - small["frames"]))
    at_20m = large["private"] + per_frame * (FRAMES_20M - large["frames"])
    print(f"measured on {large['frames']:,} and {small['frames']:,} frames; private memory per rank above an empty "
          f"import: {large['private'] / MIB:.1f} MiB and {small['private'] / MIB:.1f} MiB", flush=True)
    report("bench_dataset_memory", [
        BenchResult("rank_private_mib_at_20m_frames", round(at_20m / MIB, 1), 100, "MiB"),
        BenchResult("rank_private_bytes_per_frame", round(per_frame, 2), None, "B/frame"),
        BenchResult("rank_private_mib_measured", round(large["private"] / MIB, 1), None, "MiB"),
        BenchResult("open_s_with_cache", round(large["open_s"], 3), 2, "s"),
        BenchResult("random_items_per_s_2_ranks_x_2_workers", round(large["items_per_s"]), 10_000, "items/s",
                    GoalIs.AT_LEAST),
        BenchResult("cache_build_s", round(large["build_s"], 2), None, "s"),
        BenchResult("worker_private_dirty_mib", round(large["worker_dirty"] / MIB, 1), None, "MiB"),
        BenchResult("worker_private_dirty_bytes_per_frame",
                    round((large["worker_dirty"] - small["worker_dirty"]) / (large["frames"] - small["frames"]), 2),
                    None, "B/frame"),
        BenchResult("worker_private_clean_mapped_mib", round(large["worker_clean"] / MIB, 1), None, "MiB"),
        BenchResult("frames_measured", large["frames"], None, "frames"),
    ], BENCH_DIR)


if __name__ == "__main__":
    main()
