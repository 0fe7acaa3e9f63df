"""Writes datasets in the LeRobot v3.0 on-disk format (the layout ``LeRobotDataset`` reads).

Everything goes into the first file of the first chunk (``chunk-000/file-000``) of data, episodes
and each video key: enough for the datasets this project generates (simulation demos, tests). One
parquet row group per episode, like LeRobot's own files, so a reader can fetch an episode alone.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

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
    VIDEO_PATH,
)
from lerobot_mg.data.video import VideoEncoder, check_encodable
from lerobot_mg.errors import ConfigError, config_error

_NUMERIC_DTYPES = ("float32", "float64", "int32", "int64", "bool")
_VISUAL_DTYPES = ("image", "video")
# Visual stats come from a subsample, as in LeRobot: up to this many evenly spaced frames per
# episode, each strided down to at most about this many pixels per side.
_MAX_STATS_FRAMES = 100
_MAX_STATS_SIDE = 150
_QUANTILES = {"q01": 0.01, "q99": 0.99}


def _validate_features(features: dict[str, dict]) -> dict[str, dict]:
    if not features:
        raise config_error("features", features, "declares no feature",
                           "declare at least one, e.g. features={'action': {'dtype': 'float32', 'shape': [2]}}")
    validated: dict[str, dict] = {}
    for key, feature in features.items():
        if "/" in key:
            raise ConfigError(
                f"features[{key!r}]: the feature name contains '/', which the episodes table uses as a separator. "
                f"Fix: rename it without '/', e.g. features[{key.replace('/', '.')!r}]"
            )
        if key in DEFAULT_FEATURES:
            raise ConfigError(f"features[{key!r}]: is written by the writer itself. Fix: remove {key!r} from features")
        dtype = feature.get("dtype")
        if dtype not in _NUMERIC_DTYPES + _VISUAL_DTYPES:
            raise config_error(f"features[{key!r}]['dtype']", dtype, "is not a dtype the writer stores",
                               f"features[{key!r}]['dtype']=<one of {list(_NUMERIC_DTYPES + _VISUAL_DTYPES)}>")
        shape = tuple(int(size) for size in feature.get("shape", ()))
        if not shape or any(size < 1 for size in shape):
            raise config_error(f"features[{key!r}]['shape']", feature.get("shape"), "is not a non-empty shape",
                               f"give positive sizes, e.g. features[{key!r}]['shape']=[2]")
        if dtype in _VISUAL_DTYPES and (len(shape) != 3 or shape[2] != 3):
            raise config_error(f"features[{key!r}]['shape']", list(shape),
                               f"a {dtype} feature is an image of shape [height, width, 3] (HWC RGB)",
                               f"features[{key!r}]['shape']=[height, width, 3]")
        names = feature.get("names")
        if names is None and dtype in _VISUAL_DTYPES:
            names = ["height", "width", "channels"]
        validated[key] = {"dtype": dtype, "shape": list(shape), "names": names}
    return validated


def _arrow_type(feature: dict) -> pa.DataType:
    if feature["dtype"] in _VISUAL_DTYPES:
        return pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    value_type = pa.from_numpy_dtype(np.dtype(feature["dtype"]))
    if feature["shape"] == [1]:
        return value_type
    for size in reversed(feature["shape"]):
        value_type = pa.list_(value_type, size)
    return value_type


def _arrow_array(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """Builds a (nested) fixed-size-list column from ``values`` of shape ``(N, *shape)``."""
    if not pa.types.is_fixed_size_list(arrow_type):
        return pa.array(values.reshape(len(values)), type=arrow_type)
    flat = pa.array(values.reshape(-1))
    for size in reversed(values.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat


def _encode_png(image_HWC: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    # Level 1: most of the size saving for a fraction of the default level's encode time.
    Image.fromarray(image_HWC).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _summary_stats(values_NF: np.ndarray, shape: tuple[int, ...], count: int) -> dict[str, np.ndarray]:
    """min/max/mean/std and the quantiles over the first axis, reshaped to ``shape``, plus ``count``."""
    stats = {
        "min": values_NF.min(axis=0),
        "max": values_NF.max(axis=0),
        "mean": values_NF.mean(axis=0),
        "std": values_NF.std(axis=0),
    }
    stats.update({name: np.quantile(values_NF, q, axis=0) for name, q in _QUANTILES.items()})
    stats = {name: stat.reshape(shape) for name, stat in stats.items()}
    stats["count"] = np.array([count], dtype=np.int64)
    return stats


def _numeric_stats(values_N: np.ndarray) -> dict[str, np.ndarray]:
    values = values_N.astype(np.float64).reshape(len(values_N), -1)
    return _summary_stats(values, values_N.shape[1:], len(values_N))


def _visual_stats(frames_NHWC: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats of pixels scaled to [0, 1], shaped ``(3, 1, 1)`` like LeRobot's."""
    num_frames, height, width, _ = frames_NHWC.shape
    frame_ids = np.unique(
        np.linspace(0, num_frames - 1, min(num_frames, _MAX_STATS_FRAMES)).round().astype(int)
    )
    stride = max(1, -(-max(height, width) // _MAX_STATS_SIDE))
    sampled = frames_NHWC[frame_ids, ::stride, ::stride].astype(np.float64) / 255.0
    pixels_PC = sampled.reshape(-1, 3)
    return _summary_stats(pixels_PC, (3, 1, 1), len(frame_ids))


def aggregate_stats(per_episode: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Pools per-episode stats: exact for min/max/mean/std/count (population variance, as each
    episode's), count-weighted average for quantiles (an approximation, as in LeRobot)."""
    counts = np.array([stats["count"][0] for stats in per_episode], dtype=np.float64)
    weights = counts / counts.sum()
    means = np.stack([stats["mean"] for stats in per_episode])
    weights_b = weights.reshape(-1, *([1] * (means.ndim - 1)))
    mean = (weights_b * means).sum(axis=0)
    variances = np.stack([stats["std"] ** 2 for stats in per_episode]) + (means - mean) ** 2
    pooled = {
        "min": np.stack([stats["min"] for stats in per_episode]).min(axis=0),
        "max": np.stack([stats["max"] for stats in per_episode]).max(axis=0),
        "mean": mean,
        "std": np.sqrt((weights_b * variances).sum(axis=0)),
        "count": np.array([int(counts.sum())], dtype=np.int64),
    }
    for name in _QUANTILES:
        pooled[name] = (weights_b * np.stack([stats[name] for stats in per_episode])).sum(axis=0)
    return pooled


class LeRobotDatasetWriter:
    """Collects frames episode by episode and writes a LeRobot v3.0 dataset under ``root``.

    ``add_frame`` takes one timestep (numeric arrays of the feature's shape, images HWC uint8),
    ``save_episode`` closes an episode under a task string, ``finalize`` writes the metadata;
    ``meta/info.json`` is written last, so a dataset without it is incomplete.
    """

    def __init__(
        self,
        root: str | Path,
        fps: int,
        features: dict[str, dict],
        robot_type: str | None = None,
        video_codec: str = "h264",
    ) -> None:
        self.root = Path(root)
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise config_error("root", str(self.root), "already exists and is not empty; refusing to overwrite it",
                               "choose a new root or delete the old dataset first")
        if not isinstance(fps, int) or fps < 1:
            raise config_error("fps", fps, "is not a positive integer", "fps=<an integer >= 1>, e.g. fps=10")
        self.fps = fps
        self.robot_type = robot_type
        self.video_codec = video_codec
        self.user_features = _validate_features(features)
        self.features = {**self.user_features, **{key: dict(ft) for key, ft in DEFAULT_FEATURES.items()}}
        for key, feature in self.user_features.items():
            if feature["dtype"] == "video":
                height, width, _ = feature["shape"]
                check_encodable(key, video_codec, height, width)  # fail now, not after a long recording
        self._episode_buffer: dict[str, list[np.ndarray]] = {key: [] for key in self.user_features}
        self._tasks: dict[str, int] = {}
        self._episode_rows: list[dict[str, object]] = []
        self._numeric_values: dict[str, list[np.ndarray]] = {
            key: [] for key, ft in self.features.items() if ft["dtype"] in _NUMERIC_DTYPES
        }
        self._visual_episode_stats: dict[str, list[dict[str, np.ndarray]]] = {
            key: [] for key, ft in self.features.items() if ft["dtype"] in _VISUAL_DTYPES
        }
        self._video_encoders: dict[str, VideoEncoder] = {}
        self._parquet_writer: pq.ParquetWriter | None = None
        self._num_frames = 0
        self._finalized = False

    @property
    def num_episodes(self) -> int:
        return len(self._episode_rows)

    def add_frame(self, frame: dict[str, np.ndarray | torch.Tensor]) -> None:
        self._check_open()
        missing = sorted(set(self.user_features) - set(frame))
        extra = sorted(set(frame) - set(self.user_features))
        if missing or extra:
            raise config_error("frame.keys()", sorted(frame),
                               f"do not match the features: missing {missing}, unexpected {extra}",
                               f"add_frame() with exactly the keys {sorted(self.user_features)}")
        arrays: dict[str, np.ndarray] = {}
        for key, feature in self.user_features.items():
            value = frame[key]
            array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            shape = tuple(feature["shape"])
            if feature["dtype"] in _VISUAL_DTYPES:
                if array.dtype != np.uint8 or array.shape != shape:
                    raise ConfigError(
                        f"frame[{key!r}]: is a {array.dtype} array of shape {array.shape}, not a uint8 HWC image of "
                        f"shape {shape}. Fix: pass frame[{key!r}] as a uint8 array of shape {shape}"
                    )
            else:
                if array.size != int(np.prod(shape)) or (array.shape != shape and array.ndim > 0):
                    raise ConfigError(
                        f"frame[{key!r}].shape={array.shape!r}: the feature's shape is {shape}. Fix: pass "
                        f"frame[{key!r}] with shape {shape}, or declare features[{key!r}]['shape']={list(array.shape)}"
                    )
                array = array.astype(feature["dtype"]).reshape(shape)
            arrays[key] = array
        # Appended only once every key is valid, so a rejected frame leaves the episode untouched.
        for key, array in arrays.items():
            self._episode_buffer[key].append(array)

    def save_episode(self, task: str) -> None:
        self._check_open()
        num_frames = len(next(iter(self._episode_buffer.values())))
        if num_frames == 0:
            raise ValueError("save_episode() called with no frames; add_frame() at least once per episode.")
        if not task:
            raise config_error("task", task, "is empty; every episode needs a task description",
                               "save_episode(task='<what the robot does>')")
        episode_index = self.num_episodes
        task_index = self._tasks.setdefault(task, len(self._tasks))
        frame_index = np.arange(num_frames, dtype=np.int64)
        values: dict[str, np.ndarray] = {
            key: np.stack(arrays) for key, arrays in self._episode_buffer.items()
        }
        values["timestamp"] = (frame_index / self.fps).astype(np.float32)
        values["frame_index"] = frame_index
        values["episode_index"] = np.full(num_frames, episode_index, dtype=np.int64)
        values["index"] = self._num_frames + frame_index
        values["task_index"] = np.full(num_frames, task_index, dtype=np.int64)

        row: dict[str, object] = {
            "episode_index": episode_index,
            "tasks": [task],
            "length": num_frames,
            "data/chunk_index": 0,
            "data/file_index": 0,
            "dataset_from_index": self._num_frames,
            "dataset_to_index": self._num_frames + num_frames,
        }
        columns: dict[str, pa.Array] = {}
        for key, feature in self.features.items():
            dtype = feature["dtype"]
            if dtype == "video":
                encoder = self._video_encoder(key)
                row[f"videos/{key}/chunk_index"] = 0
                row[f"videos/{key}/file_index"] = 0
                row[f"videos/{key}/from_timestamp"] = encoder.num_frames / self.fps
                encoder.add_frames(values[key])
                row[f"videos/{key}/to_timestamp"] = encoder.num_frames / self.fps
            elif dtype == "image":
                columns[key] = pa.array(
                    [
                        {"bytes": _encode_png(image), "path": f"frame-{int(index):06d}.png"}
                        for image, index in zip(values[key], frame_index)
                    ],
                    type=_arrow_type(feature),
                )
            else:
                columns[key] = _arrow_array(values[key], _arrow_type(feature))
            if dtype in _VISUAL_DTYPES:
                episode_stats = _visual_stats(values[key])
                self._visual_episode_stats[key].append(episode_stats)
            else:
                episode_stats = _numeric_stats(values[key])
                self._numeric_values[key].append(values[key])
            for stat_name, stat in episode_stats.items():
                row[f"stats/{key}/{stat_name}"] = stat.tolist()
        row["meta/episodes/chunk_index"] = 0
        row["meta/episodes/file_index"] = 0

        # Video frames live in the mp4; the data table has no column for them.
        table = pa.table(columns)
        if self._parquet_writer is None:
            data_path = self.root / DATA_PATH.format(chunk_index=0, file_index=0)
            data_path.parent.mkdir(parents=True, exist_ok=True)
            self._parquet_writer = pq.ParquetWriter(data_path, table.schema)
        self._parquet_writer.write_table(table, row_group_size=num_frames)
        self._episode_rows.append(row)
        self._num_frames += num_frames
        self._episode_buffer = {key: [] for key in self.user_features}

    def finalize(self) -> None:
        self._check_open()
        if self.num_episodes == 0:
            raise ValueError(
                "finalize() called before any save_episode(); a dataset needs one episode or more."
            )
        if any(self._episode_buffer.values()):
            raise ValueError("finalize() called with unsaved frames; call save_episode() first.")
        assert self._parquet_writer is not None
        self._parquet_writer.close()
        for encoder in self._video_encoders.values():
            encoder.close()

        episodes_path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        episodes_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self._episode_rows), episodes_path)

        # LeRobot stores the task strings as the pandas index named "task".
        tasks = pd.DataFrame(
            {"task_index": list(self._tasks.values())}, index=pd.Index(list(self._tasks), name="task")
        )
        tasks.to_parquet(self.root / TASKS_PATH)

        stats: dict[str, dict[str, np.ndarray]] = {}
        for key, arrays in self._numeric_values.items():
            stats[key] = _numeric_stats(np.concatenate(arrays))
        for key, per_episode in self._visual_episode_stats.items():
            stats[key] = aggregate_stats(per_episode)
        _write_json(
            {
                key: {name: stat.tolist() for name, stat in feature_stats.items()}
                for key, feature_stats in stats.items()
            },
            self.root / STATS_PATH,
        )
        _write_json(self._info(), self.root / INFO_PATH)
        self._finalized = True

    def _info(self) -> dict[str, object]:
        features: dict[str, dict] = {}
        for key, feature in self.features.items():
            features[key] = dict(feature)
            if key in self._video_encoders:
                features[key]["info"] = self._video_encoders[key].info()
        return {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": self.num_episodes,
            "total_frames": self._num_frames,
            "total_tasks": len(self._tasks),
            "chunks_size": CHUNKS_SIZE,
            "data_files_size_in_mb": DATA_FILES_SIZE_IN_MB,
            "video_files_size_in_mb": VIDEO_FILES_SIZE_IN_MB,
            "fps": self.fps,
            "splits": {"train": f"0:{self.num_episodes}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self._video_encoders else None,
            "features": features,
        }

    def _video_encoder(self, key: str) -> VideoEncoder:
        if key not in self._video_encoders:
            height, width, _ = self.features[key]["shape"]
            path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0)
            self._video_encoders[key] = VideoEncoder(key, path, self.fps, height, width, self.video_codec)
        return self._video_encoders[key]

    def _check_open(self) -> None:
        if self._finalized:
            raise ValueError(
                f"the dataset at {self.root} is already finalized; start a new writer to add data."
            )


def _write_json(data: object, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=4) + "\n")
