"""Benchmark: the data loader against a raw video decode and against what a training step consumes.

    python scripts/bench_data.py                      # outputs/bench/bench_data.json
    python scripts/bench_data.py --episodes 4 --episode-length 120 --train-steps 4

Two datasets written with our own writer (so with our encoder settings), like the image preset's
(experiment=aloha_image: 240x320 H.264 at 50 fps, 14-dim state and action): one camera, and a two-camera
variant. Frames are a moving texture, not the simulator's renders (which take minutes to make); decode speed
depends on the content, so the figures that matter are the ratios measured on the same files.

1. Decode path (one core): frames/s of ``LeRobotDataset`` reading only the camera, in the shuffled order the
   sampler gives, against a raw single-threaded sequential PyAV decode of the same file to RGB arrays, both per
   second of the process's CPU time (the goal is per core, and a shared machine's load would otherwise decide
   the ratio). Goal: ``loader_decode_over_raw_decode`` >= 0.8.
2. Loader: samples/s of the training DataLoader (batch 8, 50-frame action chunks, what the policy reads,
   uint8 images) at ``num_workers`` 0, 1 and 2; worker scaling (2 workers / 1) goal >= 1.8.
3. Consumption: a real ``scripts/train.py experiment=aloha_image`` run on each dataset: samples/s of its steps
   without their data wait, and the fraction of the step time spent waiting for data (``data_frac`` of the
   ledger). Goals: loader at the default ``num_workers`` >= 3x consumption, data_frac <= 0.05.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch
from benchmarking import BenchResult, GoalIs, report

from lerobot_mg.config.schema import REPO_ROOT, TrainConfig
from lerobot_mg.data import LeRobotDataset, ResumableBatchSampler
from lerobot_mg.data.writer import LeRobotDatasetWriter

FPS = 50  # ALOHA's
HEIGHT, WIDTH = 240, 320  # the image preset's (make train-image)
DIM = 14
CAMERAS = ("observation.images.top", "observation.images.wrist")
BATCH_SIZE = 8  # experiment=aloha_image
CHUNK = 50
DEFAULT_NUM_WORKERS = TrainConfig().num_workers


def _frame(camera: int, episode: int, step: int, texture: np.ndarray) -> np.ndarray:
    """A gradient sliding over a fixed texture: motion between frames as a camera sees it, detail to encode."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    shift = (2 * step + 37 * episode + 91 * camera) % 200
    base = np.stack([(x + 2 * step) % 256, (y + step) % 256, np.full_like(x, (3 * step + 50 * camera) % 256)], -1)
    return (base // 2 + texture[shift:shift + HEIGHT, shift:shift + WIDTH]).astype(np.uint8)


def make_dataset(root: Path, num_cameras: int, episodes: int, length: int) -> Path:
    if (root / "meta" / "info.json").is_file():
        return root
    rng = np.random.default_rng(0)
    texture = rng.integers(0, 60, (HEIGHT + 200, WIDTH + 200, 3), dtype=np.uint8)
    features = {"observation.state": {"dtype": "float32", "shape": [DIM]},
                "action": {"dtype": "float32", "shape": [DIM]},
                **{CAMERAS[c]: {"dtype": "video", "shape": [HEIGHT, WIDTH, 3]} for c in range(num_cameras)}}
    writer = LeRobotDatasetWriter(root, fps=FPS, features=features, robot_type="aloha")
    for episode in range(episodes):
        for step in range(length):
            writer.add_frame({"observation.state": rng.standard_normal(DIM).astype(np.float32),
                              "action": rng.standard_normal(DIM).astype(np.float32),
                              **{CAMERAS[c]: _frame(c, episode, step, texture) for c in range(num_cameras)}})
        writer.save_episode("transfer the cube")
    writer.finalize()
    return root


def raw_decode_fps(path: Path) -> float:
    """Every frame of ``path`` in order, one thread, to RGB arrays as the loader returns them."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "NONE"
        stream.codec_context.thread_count = 1
        start, count = time.process_time(), 0
        for frame in container.decode(stream):
            frame.to_ndarray(format="rgb24")
            count += 1
        return count / (time.process_time() - start)


def decode_path_fps(dataset: LeRobotDataset, order: list[int]) -> float:
    """Frames/s of the dataset reading one camera frame per item in ``order``."""
    start = time.process_time()
    for idx in order:
        dataset[idx]
    return len(order) / (time.process_time() - start)


def decode_speeds(root: Path, camera: str, num_items: int, rounds: int) -> tuple[float, float]:
    """(raw, loader path) frames/s, the best of ``rounds`` alternating measurements of each: on a shared machine
    the best round is the one least disturbed by others."""
    video = next((root / "videos" / camera).glob("chunk-*/file-*.mp4"))
    dataset = LeRobotDataset(root, keys=[camera], uint8_visuals=True)
    # The sampler's shuffled order, as training reads it.
    order = [i for batch in ResumableBatchSampler(len(dataset), BATCH_SIZE, seed=0) for i in batch][:num_items]
    dataset[order[0]]  # opens the file: a worker keeps it open for the whole run
    raw, path = [], []
    for _ in range(rounds):
        raw.append(raw_decode_fps(video))
        path.append(decode_path_fps(dataset, order))
    return max(raw), max(path)


def loader_samples_per_s(root: Path, num_workers: int, num_batches: int) -> float:
    """The training DataLoader's samples/s after its first batch (worker start-up is a once-per-run cost)."""
    info = json.loads((root / "meta" / "info.json").read_text())
    keys = [key for key in info["features"] if key.startswith("observation.") or key == "action"]
    dataset = LeRobotDataset(root, {"action": [i / FPS for i in range(CHUNK)]}, keys=keys, uint8_visuals=True)
    sampler = ResumableBatchSampler(len(dataset), BATCH_SIZE, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    next(batches)
    start = time.perf_counter()
    for _ in range(num_batches):
        next(batches)
    return num_batches * BATCH_SIZE / (time.perf_counter() - start)


def train_consumption(root: Path, num_cameras: int, steps: int, run_dir: Path) -> tuple[float, float]:
    """(samples/s of the training steps without their data wait, data_frac) of a real aloha_image run, from its
    ledger's last interval (the first one holds the start-up steps)."""
    cameras = ",".join(CAMERAS[:num_cameras])
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "train.py"), "experiment=aloha_image", f"dataset.root={root}",
           f"policy.observation_keys=[observation.state,{cameras}]", f"steps={2 * steps}", f"log_freq={steps}",
           "scheduler=constant", "eval.n_episodes=0", "checkpoint.save_checkpoint=false", f"output_dir={run_dir}",
           "logging.progress_bar=false"]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
        "OMP_NUM_THREADS", "1")}, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    metrics = [r for r in records if r["kind"] == "interval"][-1]["metrics"]
    return metrics["samples_per_s"] / (1 - metrics["data_frac"]), metrics["data_frac"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--episode-length", type=int, default=150)
    parser.add_argument("--decode-items", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="decode measurements, alternating; the best counts")
    parser.add_argument("--loader-batches", type=int, default=30)
    parser.add_argument("--train-steps", type=int, default=4, help="loop steps per measured interval")
    parser.add_argument("--workdir", type=Path, default=None, help="where the datasets and runs go (a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: list[BenchResult] = []
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        workdir = args.workdir or Path(tmp)
        for num_cameras in (1, 2):
            tag = f"{num_cameras}cam"
            root = make_dataset(workdir / f"data_{tag}", num_cameras, args.episodes, args.episode_length)
            if num_cameras == 1:
                raw, decode = decode_speeds(root, CAMERAS[0], args.decode_items, args.rounds)
                results += [BenchResult("raw_decode_fps", raw, None, "frames/s"),
                            BenchResult("loader_decode_fps", decode, None, "frames/s"),
                            BenchResult("loader_decode_over_raw_decode", decode / raw, 0.8, "x", GoalIs.AT_LEAST)]
            speeds = {n: loader_samples_per_s(root, n, args.loader_batches) for n in (0, 1, 2)}
            results += [BenchResult(f"loader_{tag}_workers{n}", s, None, "samples/s") for n, s in speeds.items()]
            results.append(BenchResult(f"loader_{tag}_workers2_over_workers1", speeds[2] / speeds[1], 1.8, "x",
                                       GoalIs.AT_LEAST))
            consumption, data_frac = train_consumption(root, num_cameras, args.train_steps,
                                                      Path(tempfile.mkdtemp(prefix=f"run_{tag}_", dir=workdir)))
            results += [
                BenchResult(f"train_{tag}_consumption", consumption, None, "samples/s"),
                BenchResult(f"loader_{tag}_over_consumption", speeds[DEFAULT_NUM_WORKERS] / consumption, 3.0, "x",
                            GoalIs.AT_LEAST),
                BenchResult(f"train_{tag}_data_frac", data_frac, 0.05, "of step time", GoalIs.AT_MOST),
            ]
    report("bench_data", results)


if __name__ == "__main__":
    main()
