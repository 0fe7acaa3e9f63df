"""A LeRobot v3.0 state dataset of any size, written straight with pyarrow (seconds for millions of frames, where the
frame-by-frame writer takes minutes): for measuring the reader at scale (``scripts/bench_dataset_memory.py``) and
in tests. The layout and columns are those ``LeRobotDatasetWriter`` writes; values are random."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lerobot_mg.data.meta import (
    CHUNKS_SIZE,
    CODEBASE_VERSION,
    DATA_FILES_SIZE_IN_MB,
    DATA_PATH,
    DEFAULT_FEATURES,
    EPISODES_PATH,
    INFO_PATH,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_FILES_SIZE_IN_MB,
)

STATE_KEYS = ("observation.state", "action")
TASK = "transfer the cube"


def write_state_dataset(root: str | Path, num_frames: int, dim: int = 14, episode_length: int = 100,
                        num_files: int = 4, fps: int = 50, seed: int = 0) -> Path:
    """``root`` holding ``num_frames`` frames of ``observation.state`` and ``action`` (``dim`` float32 each) in
    episodes of ``episode_length`` frames, the episodes spread over ``num_files`` data files."""
    root = Path(root)
    if (root / INFO_PATH).is_file():
        raise FileExistsError(f"{root} already holds a dataset")
    rng = np.random.default_rng(seed)
    num_episodes = -(-num_frames // episode_length)
    lengths = np.full(num_episodes, episode_length, dtype=np.int64)
    lengths[-1] = num_frames - episode_length * (num_episodes - 1)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    file_of_episode = np.arange(num_episodes) * num_files // num_episodes
    stats: dict[str, dict[str, list]] = {}
    for file_index in range(num_files):
        episodes = np.flatnonzero(file_of_episode == file_index)
        if not len(episodes):
            continue
        first, last = int(starts[episodes[0]]), int(starts[episodes[-1]] + lengths[episodes[-1]])
        index = np.arange(first, last, dtype=np.int64)
        episode_index = np.repeat(episodes, lengths[episodes]).astype(np.int64)
        frame_index = index - np.repeat(starts[episodes], lengths[episodes])
        columns = {key: pa.FixedSizeListArray.from_arrays(
            pa.array(rng.standard_normal((len(index), dim), dtype=np.float32).reshape(-1)), dim)
            for key in STATE_KEYS}
        columns.update(timestamp=pa.array((frame_index / fps).astype(np.float32)), frame_index=pa.array(frame_index),
                       episode_index=pa.array(episode_index), index=pa.array(index),
                       task_index=pa.array(np.zeros(len(index), dtype=np.int64)))
        path = root / DATA_PATH.format(chunk_index=0, file_index=file_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(columns), path, row_group_size=episode_length * 1000)
    episodes_table = pa.table({
        "episode_index": pa.array(np.arange(num_episodes, dtype=np.int64)),
        "tasks": pa.array([[TASK]] * num_episodes),
        "length": pa.array(lengths),
        "data/chunk_index": pa.array(np.zeros(num_episodes, dtype=np.int64)),
        "data/file_index": pa.array(file_of_episode.astype(np.int64)),
        "dataset_from_index": pa.array(starts.astype(np.int64)),
        "dataset_to_index": pa.array((starts + lengths).astype(np.int64)),
        "meta/episodes/chunk_index": pa.array(np.zeros(num_episodes, dtype=np.int64)),
        "meta/episodes/file_index": pa.array(np.zeros(num_episodes, dtype=np.int64)),
    })
    episodes_path = root / EPISODES_PATH.format(chunk_index=0, file_index=0)
    episodes_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(episodes_table, episodes_path)
    pq.write_table(pa.table({"task_index": [0], "task": [TASK]}), root / TASKS_PATH)
    for key in STATE_KEYS:  # standard normal values: the stats of the distribution they are drawn from
        stats[key] = {"mean": [0.0] * dim, "std": [1.0] * dim, "min": [-5.0] * dim, "max": [5.0] * dim,
                      "count": [num_frames]}
    (root / STATS_PATH).write_text(json.dumps(stats))
    features = {key: {"dtype": "float32", "shape": [dim], "names": None} for key in STATE_KEYS}
    info = {"codebase_version": CODEBASE_VERSION, "robot_type": "aloha", "total_episodes": num_episodes,
            "total_frames": num_frames, "total_tasks": 1, "chunks_size": CHUNKS_SIZE,
            "data_files_size_in_mb": DATA_FILES_SIZE_IN_MB, "video_files_size_in_mb": VIDEO_FILES_SIZE_IN_MB,
            "fps": fps, "splits": {"train": f"0:{num_episodes}"}, "data_path": DATA_PATH, "video_path": None,
            "features": {**features, **DEFAULT_FEATURES}}
    (root / INFO_PATH).write_text(json.dumps(info, indent=4))
    return root
