"""Reader for the LeRobot v3.0 on-disk dataset format, from a local directory.

Layout (names as in huggingface/lerobot ``src/lerobot/datasets/utils.py``)::

    meta/info.json            fps, features, path templates, codebase_version "v3.0"
    meta/stats.json           {feature: {min, max, mean, std, count, q01, ...}}
    meta/tasks.parquet        task_index + the task string (pandas index "task", or "__index_level_0__")
    meta/episodes/chunk-*/file-*.parquet   one row per episode: length, dataset_from_index/_to_index,
                              data/chunk_index, data/file_index, videos/<key>/{chunk_index, file_index,
                              from_timestamp, to_timestamp}, stats/<key>/<stat>
    data/chunk-*/file-*.parquet            one row per frame; images as struct<bytes: PNG, path>
    videos/<key>/chunk-*/file-*.mp4        several episodes per file, one after the other

The numeric columns are read once into numpy arrays; images are decoded per item and video frames
are decoded per item by seeking (see ``lerobot_mg.data.video`` for the accuracy of video frames and the seek
strategy). Only the features asked for (``keys``: in training, the policy's inputs and its action) are read:
a dataset whose unused cameras were never downloaded trains a policy that does not read them.

Start-up checks, cheap enough for every start (no frame is decoded): every data and video file the selected
episodes and features need exists, the data files' columns are the features info.json declares, and each video
holds as many frames as its container header says the episodes need. A broken dataset fails before the first
step with the file named.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from PIL import Image

from lerobot_mg.data.meta import (
    DATA_PATH,
    DEFAULT_FEATURES,
    INFO_PATH,
    REDOWNLOAD_ADVICE,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    DatasetMeta,
)
from lerobot_mg.data.video import VideoFrameReader, video_frame_count
from lerobot_mg.errors import ConfigError, config_error


def _column_to_numpy(column: pa.ChunkedArray, shape: tuple[int, ...]) -> np.ndarray:
    """``(N, *shape)`` array from a scalar or (nested, fixed or variable size) list column."""
    array = column.combine_chunks()
    while (
        pa.types.is_list(array.type)
        or pa.types.is_fixed_size_list(array.type)
        or pa.types.is_large_list(array.type)
    ):
        array = array.flatten()
    return array.to_numpy(zero_copy_only=False).reshape(len(column), *shape)


def _decode_png(data: bytes) -> np.ndarray:
    """uint8 ``(H, W, 3)``."""
    # BytesIO shares the bytes object until written to, so this does not copy the PNG payload.
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _visual_tensor(frames_THWC: np.ndarray, uint8: bool) -> torch.Tensor:
    """``(T, C, H, W)``: uint8 as decoded, or float32 in [0, 1]."""
    frames = torch.from_numpy(frames_THWC).permute(0, 3, 1, 2)
    # The uint8 view is not copied here: collating a batch copies it into one (shared-memory) tensor anyway.
    return frames if uint8 else frames.float().div_(255.0)


class LeRobotDataset(torch.utils.data.Dataset):
    """Frames of a local LeRobot v3.0 dataset as dicts of tensors.

    ``dataset[i]`` holds the features named in ``keys`` (every feature when None) and the default ones:
    float features as float32 tensors of the feature's shape, images and video frames as float32
    ``(C, H, W)`` in [0, 1] (uint8 in 0..255 with ``uint8_visuals``: a quarter of the bytes through the
    DataLoader's worker pipes, for the device to scale: ``lerobot_mg.step.to_device``), ``index``/``episode_index``/
    ``frame_index``/``task_index`` as int64 scalars, ``timestamp`` as a float32 scalar and ``task``
    as a string. A key in ``delta_timestamps`` gets a leading time dim: frames at those offsets (in
    seconds, multiples of 1/fps) from the current one, clamped to the episode's first/last frame,
    with ``<key>_is_pad`` (bool ``(T,)``) marking the clamped ones.
    """

    def __init__(
        self,
        root: str | Path | DatasetMeta,
        delta_timestamps: dict[str, list[float]] | None = None,
        episodes: list[int] | None = None,
        tolerance_s: float = 1e-4,
        keys: Collection[str] | None = None,
        uint8_visuals: bool = False,
    ) -> None:
        # The metadata a start already read (preflight) is passed in, so its files are not read again.
        self.meta = root if isinstance(root, DatasetMeta) else DatasetMeta.read(root)
        self.root = self.meta.root
        self.info: dict = self.meta.info
        self.fps = self.meta.fps
        self.features: dict[str, dict] = self.meta.features
        self.tolerance_s = tolerance_s
        self.uint8_visuals = uint8_visuals
        self.read_keys = self._read_keys(keys)
        self.video_keys = [key for key in self.read_keys if self.features[key]["dtype"] == "video"]
        self.visual_keys = [key for key in self.read_keys if self.features[key]["dtype"] in ("image", "video")]
        self.stats = self._load_stats()
        self._task_names = self._load_tasks()
        self.delta_indices = self._delta_indices(delta_timestamps or {})

        episodes_table = self.meta.select(episodes)
        self.episode_indices: list[int] = episodes_table.column("episode_index").to_pylist()
        self.num_episodes = len(self.episode_indices)
        self._load_frames(episodes_table)
        self._check_videos(episodes_table)
        self._video_reader = VideoFrameReader()
        # Cameras decode in parallel threads (PyAV releases the GIL while it decodes); one thread per camera.
        self._decode_pool: ThreadPoolExecutor | None = None
        self._decode_pool_pid = os.getpid()

    def _read_keys(self, keys: Collection[str] | None) -> list[str]:
        """The features to read, in info.json's order: ``keys`` and the default (index) features."""
        if keys is None:
            return list(self.features)
        unknown = sorted(set(keys) - set(self.features))
        if unknown:
            raise ConfigError(
                f"{self.root / INFO_PATH}: has no features {unknown}, which the policy reads; it has "
                f"{sorted(self.features)}. Fix: policy.observation_keys=[...] naming features of this dataset."
            )
        return [key for key in self.features if key in keys or key in DEFAULT_FEATURES]

    # ----------------------------------------------------------------------------------- loading

    def _load_stats(self) -> dict[str, dict[str, torch.Tensor]]:
        stats_path = self.root / STATS_PATH
        # Stats are optional in the format (a dataset can be read before stats are computed).
        if not stats_path.is_file():
            return {}
        raw = json.loads(stats_path.read_text())
        return {
            key: {
                name: torch.tensor(np.asarray(value, dtype=np.float32))
                for name, value in feature_stats.items()
            }
            for key, feature_stats in raw.items()
        }

    def _load_tasks(self) -> dict[int, str]:
        table = pq.read_table(self.root / TASKS_PATH)
        # pandas writes the task strings as its index: a column named after the index ("task" in
        # LeRobot's files) or "__index_level_0__" when the index was unnamed.
        for name in ("task", "__index_level_0__"):
            if name in table.column_names:
                tasks = table.column(name).to_pylist()
                break
        else:
            raise ConfigError(
                f"{self.root / TASKS_PATH}: has columns {table.column_names}; expected the task strings in a "
                "'task' or '__index_level_0__' column next to 'task_index'. Fix: " + REDOWNLOAD_ADVICE + "."
            )
        return dict(zip(table.column("task_index").to_pylist(), tasks))

    def _load_frames(self, episodes_table: pa.Table) -> None:
        data_files = sorted(
            set(
                zip(
                    episodes_table.column("data/chunk_index").to_pylist(),
                    episodes_table.column("data/file_index").to_pylist(),
                )
            )
        )
        data_template = self.info.get("data_path", DATA_PATH)
        data_paths = [self.root / data_template.format(chunk_index=chunk, file_index=file) for chunk, file in data_files]
        columns = self._check_data_files(data_paths)
        wanted = pa.array(self.episode_indices, type=pa.int64())
        tables = []
        for path in data_paths:
            table = pq.read_table(path, columns=columns)  # an unread camera's PNG bytes stay on disk
            tables.append(table.filter(pc.is_in(table.column("episode_index"), value_set=wanted)))
        table = pa.concat_tables(tables, promote_options="permissive")
        table = table.take(pc.sort_indices(table.column("index")))
        self.num_frames = table.num_rows

        self._numeric: dict[str, np.ndarray] = {}
        self._images: dict[str, pa.BinaryArray] = {}
        self._strings: dict[str, list[str]] = {}
        for key in columns:
            dtype = self.features[key]["dtype"]
            if dtype == "image":
                images = table.column(key).combine_chunks().field("bytes")
                if images.null_count:
                    raise ConfigError(
                        f"{self.root}: {images.null_count} frames of image feature {key!r} have no embedded "
                        "bytes; this reader needs images embedded in the parquet files. Fix: embed the images "
                        "(LeRobot's writer does) or leave the feature out of policy.observation_keys."
                    )
                self._images[key] = images
            elif dtype == "string":
                self._strings[key] = table.column(key).to_pylist()
            else:
                # Default features are scalars per frame; others keep their declared shape.
                shape = () if key in DEFAULT_FEATURES else tuple(self.features[key]["shape"])
                self._numeric[key] = _column_to_numpy(table.column(key), shape)

        episode_index = self._numeric["episode_index"]
        is_first = np.r_[True, episode_index[1:] != episode_index[:-1]]
        starts = np.flatnonzero(is_first)
        ends = np.r_[starts[1:], self.num_frames]
        lengths = dict(
            zip(
                episodes_table.column("episode_index").to_pylist(),
                episodes_table.column("length").to_pylist(),
            )
        )
        for start, end in zip(starts, ends):
            episode = int(episode_index[start])
            if lengths.get(episode) != end - start:
                raise ConfigError(
                    f"{self.root}: episode {episode} has {end - start} frames in the data files but length "
                    f"{lengths.get(episode)} in the episodes table; the dataset is inconsistent. Fix: {REDOWNLOAD_ADVICE}."
                )
        self._episode_start = np.repeat(starts, ends - starts)
        self._episode_end = np.repeat(ends, ends - starts)

        # Per episode and video key read: (mp4 path, the episode's start time inside that file).
        video_template = self.info.get("video_path") or VIDEO_PATH
        self._video_locations: dict[int, dict[str, tuple[Path, float]]] = {}
        for row in episodes_table.select(
            ["episode_index"]
            + [
                f"videos/{key}/{name}"
                for key in self.video_keys
                for name in ("chunk_index", "file_index", "from_timestamp")
            ]
        ).to_pylist():
            self._video_locations[row["episode_index"]] = {
                key: (
                    self.root
                    / video_template.format(
                        video_key=key,
                        chunk_index=row[f"videos/{key}/chunk_index"],
                        file_index=row[f"videos/{key}/file_index"],
                    ),
                    float(row[f"videos/{key}/from_timestamp"]),
                )
                for key in self.video_keys
            }

    def _check_data_files(self, paths: list[Path]) -> list[str]:
        """The data columns to read; raises unless every file exists with a column per non-video feature of
        info.json and no other (from the parquet footers: nothing is read)."""
        expected = {key for key, ft in self.features.items() if ft["dtype"] != "video"}
        for path in paths:
            if not path.is_file():
                raise ConfigError(
                    f"{path}: does not exist, but the episodes table of {self.root} places frames in it. "
                    f"Fix: {REDOWNLOAD_ADVICE}."
                )
            names = set(pq.read_schema(path).names) - {"__index_level_0__"}  # a pandas index is not a feature
            missing, extra = sorted(expected - names), sorted(names - expected)
            if missing or extra:
                raise ConfigError(
                    f"{path}: disagrees with {self.root / INFO_PATH}: features without a column {missing}, columns "
                    f"without a feature {extra}. The metadata belongs to another revision of the dataset. "
                    f"Fix: {REDOWNLOAD_ADVICE}."
                )
        return [key for key in self.read_keys if key in expected]

    def _check_videos(self, episodes_table: pa.Table) -> None:
        """Every video file read exists and holds the frames the episodes table places in it (from its header)."""
        needed: dict[Path, tuple[float, int]] = {}  # path -> (end time in the file, the episode that ends there)
        for row in episodes_table.select(["episode_index", "length"]).to_pylist():
            for path, from_timestamp in self._video_locations[row["episode_index"]].values():
                end_s = from_timestamp + row["length"] / self.fps
                if end_s > needed.get(path, (-1.0, 0))[0]:
                    needed[path] = (end_s, row["episode_index"])
        for path, (end_s, episode) in needed.items():
            if not path.is_file():
                raise ConfigError(
                    f"{path}: does not exist, but the policy reads its camera. Fix: {REDOWNLOAD_ADVICE}, or leave the "
                    "camera out of policy.observation_keys."
                )
            frames_needed = round(end_s * self.fps)
            frames = video_frame_count(path, self.fps)
            if frames < frames_needed:
                raise ConfigError(
                    f"{path}: holds {frames} frames but episode {episode} ends at {end_s:.3f}s in it "
                    f"({frames_needed} frames at {self.fps} fps): the video is truncated or belongs to another "
                    f"revision of the dataset. Fix: {REDOWNLOAD_ADVICE}."
                )

    def _delta_indices(self, delta_timestamps: dict[str, list[float]]) -> dict[str, np.ndarray]:
        """Frame offsets per key; each delta must be a multiple of 1/fps within ``tolerance_s``."""
        delta_indices: dict[str, np.ndarray] = {}
        for key, deltas in delta_timestamps.items():
            if key not in self.features or key in DEFAULT_FEATURES:
                raise ConfigError(
                    f"delta_timestamps[{key!r}]: {key!r} is not a feature of {self.root}. Fix: key delta_timestamps "
                    f"by features among {[k for k in self.features if k not in DEFAULT_FEATURES]}"
                )
            if len(deltas) == 0:
                raise config_error(f"delta_timestamps[{key!r}]", list(deltas), "holds no offset",
                                   f"give at least one, e.g. delta_timestamps[{key!r}]=[0.0]")
            offsets = np.asarray(deltas, dtype=np.float64) * self.fps
            rounded = np.round(offsets)
            off_grid = np.abs(offsets - rounded) / self.fps > self.tolerance_s
            if off_grid.any():
                bad = [float(deltas[i]) for i in np.flatnonzero(off_grid)]
                raise config_error(
                    f"delta_timestamps[{key!r}]", [float(delta) for delta in deltas],
                    f"{bad} are not multiples of 1/fps = {1 / self.fps:.6f}s (fps={self.fps}) within "
                    f"tolerance_s={self.tolerance_s}", f"use offsets k/{self.fps} for integer k",
                )
            delta_indices[key] = rounded.astype(np.int64)
        return delta_indices

    # ----------------------------------------------------------------------------------- access

    def __len__(self) -> int:
        return self.num_frames

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor | str]:
        if not 0 <= idx < self.num_frames:
            raise IndexError(f"index {idx} is out of range for a dataset of {self.num_frames} frames.")
        item: dict[str, torch.Tensor | str] = {}
        rows_by_key: dict[str, np.ndarray | int] = {}
        for key, offsets in self.delta_indices.items():
            start, end = self._episode_start[idx], self._episode_end[idx]
            query = idx + offsets
            rows_by_key[key] = np.clip(query, start, end - 1)
            item[f"{key}_is_pad"] = torch.from_numpy((query < start) | (query >= end))

        for key, values in self._numeric.items():
            tensor = torch.tensor(values[rows_by_key.get(key, idx)])
            item[key] = tensor.float() if tensor.is_floating_point() else tensor
        for key, values in self._strings.items():
            item[key] = values[idx]
        for key, images in self._images.items():
            rows = rows_by_key.get(key)
            frame_rows = np.atleast_1d(idx if rows is None else rows)
            frames = _visual_tensor(np.stack([_decode_png(images[int(row)].as_py()) for row in frame_rows]),
                                    self.uint8_visuals)
            item[key] = frames[0] if rows is None else frames
        if self.video_keys:
            locations = self._video_locations[int(self._numeric["episode_index"][idx])]

            def decode(key: str) -> torch.Tensor:
                rows = rows_by_key.get(key)
                frame_rows = np.atleast_1d(idx if rows is None else rows)
                path, from_timestamp = locations[key]
                timestamps = [from_timestamp + float(t) for t in self._numeric["timestamp"][frame_rows]]
                frames = _visual_tensor(self._video_reader.decode(path, timestamps, self.tolerance_s),
                                        self.uint8_visuals)
                return frames[0] if rows is None else frames

            if len(self.video_keys) == 1:
                item[self.video_keys[0]] = decode(self.video_keys[0])
            else:
                if self._decode_pool is None or self._decode_pool_pid != os.getpid():
                    # A forked worker inherits the parent's pool object but none of its threads: make its own.
                    self._decode_pool = ThreadPoolExecutor(len(self.video_keys), thread_name_prefix="decode")
                    self._decode_pool_pid = os.getpid()
                item.update(zip(self.video_keys, self._decode_pool.map(decode, self.video_keys)))
        item["task"] = self._task_names[int(self._numeric["task_index"][idx])]
        return item

    def fingerprint(self) -> str:
        """The dataset revision's hash (:attr:`DatasetMeta.fingerprint`)."""
        return self.meta.fingerprint

    def __getstate__(self) -> dict:
        # Open video containers cannot cross a process boundary (DataLoader workers under spawn).
        state = self.__dict__.copy()
        state["_video_reader"] = VideoFrameReader()
        state["_decode_pool"] = None  # threads do not cross a process boundary either
        return state
