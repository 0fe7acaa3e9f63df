"""Builders for small LeRobot v3.0 datasets written with lerobot_mg's writer, for the tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lerobot_mg.data.writer import LeRobotDatasetWriter

TINY_FPS = 10
TINY_EPISODE_LENGTHS = (6, 9, 7)
TINY_TASKS = ("pick up the cube", "put the cube down", "pick up the cube")
STATE_DIM = 4
ACTION_DIM = 3
ENV_STATE_DIM = 5
IMAGE_KEY = "observation.images.wrist"
VIDEO_KEY = "observation.images.top"
# Different heights and widths so that a transposed image cannot pass for a correct one.
IMAGE_SHAPE_HWC = (24, 32, 3)
VIDEO_SHAPE_HWC = (32, 48, 3)


@dataclass
class TinyDataset:
    """What ``write_tiny_dataset`` wrote, frame by frame over all episodes, for comparisons."""

    root: Path
    frames: dict[str, np.ndarray]  # key -> (num_frames, *shape), in dataset index order
    episode_index: np.ndarray  # (num_frames,)
    frame_index: np.ndarray  # (num_frames,)
    tasks: list[str]  # per frame


def tiny_features(with_video: bool = True) -> dict[str, dict]:
    features: dict[str, dict] = {
        "observation.state": {"dtype": "float32", "shape": [STATE_DIM], "names": None},
        "action": {"dtype": "float32", "shape": [ACTION_DIM], "names": None},
        "observation.environment_state": {"dtype": "float32", "shape": [ENV_STATE_DIM], "names": None},
        IMAGE_KEY: {"dtype": "image", "shape": list(IMAGE_SHAPE_HWC), "names": None},
    }
    if with_video:
        features[VIDEO_KEY] = {"dtype": "video", "shape": list(VIDEO_SHAPE_HWC), "names": None}
    return features


def smooth_video_frame(episode_index: int, frame_index: int) -> np.ndarray:
    """A gradient that lossy codecs keep within a few levels; every frame and episode differs from
    its neighbours by at least 10 levels on average, so a wrong frame cannot pass for a right one."""
    height, width, _ = VIDEO_SHAPE_HWC
    y, x = np.mgrid[0:height, 0:width]
    red = 30 + 2 * x + 10 * frame_index
    green = 30 + 3 * y + 20 * episode_index
    blue = np.full_like(x, 60 + 40 * episode_index + 5 * frame_index)
    return np.stack([red, green, blue], axis=-1).clip(0, 255).astype(np.uint8)


def write_tiny_dataset(
    root: str | Path,
    episode_lengths: tuple[int, ...] = TINY_EPISODE_LENGTHS,
    tasks: tuple[str, ...] = TINY_TASKS,
    with_video: bool = True,
    video_codec: str = "h264",
    seed: int = 0,
) -> TinyDataset:
    """Writes a dataset of ``len(episode_lengths)`` episodes with state, action, environment state,
    a PNG ``image`` feature (random pixels) and, optionally, an mp4 ``video`` feature (gradients)."""
    rng = np.random.default_rng(seed)
    features = tiny_features(with_video)
    writer = LeRobotDatasetWriter(
        root, fps=TINY_FPS, features=features, robot_type="tiny", video_codec=video_codec
    )
    written: dict[str, list[np.ndarray]] = {key: [] for key in features}
    episode_index: list[int] = []
    frame_index: list[int] = []
    frame_tasks: list[str] = []
    for episode, (length, task) in enumerate(zip(episode_lengths, tasks, strict=True)):
        for step in range(length):
            frame = {
                "observation.state": rng.standard_normal(STATE_DIM).astype(np.float32),
                "action": rng.standard_normal(ACTION_DIM).astype(np.float32),
                "observation.environment_state": rng.standard_normal(ENV_STATE_DIM).astype(np.float32),
                IMAGE_KEY: rng.integers(0, 256, IMAGE_SHAPE_HWC, dtype=np.uint8),
            }
            if with_video:
                frame[VIDEO_KEY] = smooth_video_frame(episode, step)
            writer.add_frame(frame)
            for key, value in frame.items():
                written[key].append(value)
            episode_index.append(episode)
            frame_index.append(step)
            frame_tasks.append(task)
        writer.save_episode(task)
    writer.finalize()
    return TinyDataset(
        root=Path(root),
        frames={key: np.stack(values) for key, values in written.items()},
        episode_index=np.asarray(episode_index),
        frame_index=np.asarray(frame_index),
        tasks=frame_tasks,
    )
