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

import importlib
import io
import json
import os
import re
import string
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from lerobot_mg.data.frames import FrameStore
from lerobot_mg.data.meta import (
    DATA_PATH,
    DEFAULT_FEATURES,
    INFO_PATH,
    REDOWNLOAD_ADVICE,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    DatasetMeta,
    episode_column,
    read_parquet,
)
from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.safe_paths import contained

# The format spec a path template's field may carry: a zero-padded width of at most two digits (LeRobot's ":03d").
_TEMPLATE_SPEC = re.compile(r"^(0?[0-9]{1,2})?d?$")

if TYPE_CHECKING:
    from lerobot_mg.data.video import VideoFrameReader


def _video() -> ModuleType:
    """``lerobot_mg.data.video``, imported when a run reads a camera stored as video: PyAV takes about 0.3 s to
    import, in every rank and DataLoader worker, and a run on states or PNG images never decodes a video."""
    return importlib.import_module("lerobot_mg.data.video")


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
        self._check_videos()
        self._video_reader = self._new_video_reader()
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

    def _new_video_reader(self) -> VideoFrameReader | None:
        """A ``VideoFrameReader`` with no file open yet, or None when no video key is read."""
        return _video().VideoFrameReader() if self.video_keys else None

    def _load_tasks(self) -> dict[int, str]:
        table = read_parquet(self.root / TASKS_PATH)
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
        """Map the cache entry of the columns read (built on the first start) and lay out the selected episodes:
        ``_first[e]``, ``_length[e]``: dataset index of episode ``e``'s first frame and its frames; ``_shift[e]``:
        row of that frame in the cache minus the dataset index (frames of one episode are consecutive rows)."""
        data_files = np.unique(np.stack([episode_column(episodes_table, "data/chunk_index"),
                                         episode_column(episodes_table, "data/file_index")], axis=1), axis=0).tolist()
        data_template = self._path_template("data_path", DATA_PATH, ("chunk_index", "file_index"))
        data_paths = [contained(self.root, data_template.format(chunk_index=chunk, file_index=file),
                                self.root / INFO_PATH, "data_path", REDOWNLOAD_ADVICE) for chunk, file in data_files]
        columns = self._check_data_files(data_paths)
        self._frames = FrameStore(self.root, self.meta.fingerprint, self.features, columns, data_paths,
                                  self.meta.lengths)
        rows, lengths = self._frames.rows_of(self.episode_indices)
        in_row_order = self._frames.episode_index[np.searchsorted(self._frames.episode_row, rows)]
        missing = sorted(set(self.episode_indices) - set(in_row_order.tolist()))
        if missing:
            raise ConfigError(f"{self.root}: episodes {missing[:10]} have no frames in the data files the episodes "
                              f"table places them in; the dataset is inconsistent. Fix: {REDOWNLOAD_ADVICE}.")
        self._episode_order = in_row_order  # episode index of each selected episode, in the order of its frames
        self._length = lengths
        self._first = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
        self._shift = rows - self._first
        self.cache_dir = self._frames.folder.parent  # this dataset's cache folder (lerobot_mg.data.cache)
        self.num_frames = int(lengths.sum())
        self._share_columns()

        # Per selected episode (in the order of its frames) and video key read: the mp4's chunk and file, and the
        # episode's start time inside that file.
        table_index = episode_column(episodes_table, "episode_index")
        position = np.searchsorted(table_index, in_row_order)
        self._video_template = self._path_template("video_path", VIDEO_PATH, ("video_key", "chunk_index", "file_index"))
        self._video_locations: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {
            key: tuple(episode_column(episodes_table, f"videos/{key}/{name}")[position]
                       for name in ("chunk_index", "file_index", "from_timestamp"))
            for key in self.video_keys
        }

    def _share_columns(self) -> None:
        """The memory-mapped columns, by kind (views of the frame store's, never pickled themselves)."""
        self._numeric = self._frames.numeric
        kinds = {key: self.features[key]["dtype"] for key in self._frames.binary}
        self._images = {key: values for key, values in self._frames.binary.items() if kinds[key] == "image"}
        self._strings = {key: values for key, values in self._frames.binary.items() if kinds[key] == "string"}

    def _path_template(self, key: str, default: str, fields: tuple[str, ...]) -> str:
        """info.json's ``key`` (``data_path``, ``video_path``; ``default`` when it has none): a template of file paths
        whose only fields are ``fields``, the numbers with at most a two-digit zero-padded width
        (``{chunk_index:03d}``), as LeRobot writes them. Anything else (an attribute or index lookup, a conversion, a width that makes a
        gigabyte of text) is refused naming the file: info.json may come from someone else."""
        template = self.info.get(key) or default
        problem = None if isinstance(template, str) else "is not a string"
        try:
            parsed = list(string.Formatter().parse(template)) if problem is None else []
        except ValueError as error:
            problem = f"is not a path template ({error})"
            parsed = []
        for _, name, spec, conversion in parsed:
            spec_ok = not spec if name == "video_key" else _TEMPLATE_SPEC.match(spec or "")  # a str: no width
            if name is not None and (name not in fields or conversion or not spec_ok):
                field = f"{{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
                allowed = ", ".join("{" + known + "}" for known in fields)
                problem = (f"has the field {field}; a path template holds only {allowed}, the numbers with at most a "
                           "zero-padded width such as :03d")
                break
        if problem is not None:
            raise ConfigError(f"{self.root / INFO_PATH}: {key}={template!r} {problem}. Fix: {REDOWNLOAD_ADVICE}.")
        return template

    def _video_file(self, key: str, episode: int) -> str:
        """The mp4 of ``episode`` (position among the selected ones) for camera ``key``, relative to the root."""
        chunk, file, _ = self._video_locations[key]
        return self._video_template.format(video_key=key, chunk_index=int(chunk[episode]),
                                           file_index=int(file[episode]))

    def _video_location(self, key: str, episode: int) -> tuple[Path, float]:
        """(mp4 path, start time inside it) of ``episode`` (position among the selected ones) for camera ``key``:
        a path :meth:`_check_videos` kept inside the root."""
        return self.root / self._video_file(key, episode), float(self._video_locations[key][2][episode])

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

    def _check_videos(self) -> None:
        """Every video file read is a regular file inside the root, exists and holds the frames the episodes table
        places in it (from its header)."""
        needed: dict[str, tuple[float, int]] = {}  # file -> (end time in it, the episode that ends there)
        for key in self.video_keys:
            for position, (episode, length) in enumerate(zip(self._episode_order.tolist(), self._length.tolist())):
                end_s = float(self._video_locations[key][2][position]) + length / self.fps
                name = self._video_file(key, position)
                if end_s > needed.get(name, (-1.0, 0))[0]:
                    needed[name] = (end_s, episode)
        for name, (end_s, episode) in needed.items():
            path = contained(self.root, name, self.root / INFO_PATH, "video_path", REDOWNLOAD_ADVICE)
            if not path.is_file():
                raise ConfigError(
                    f"{path}: does not exist, but the policy reads its camera. Fix: {REDOWNLOAD_ADVICE}, or leave the "
                    "camera out of policy.observation_keys."
                )
            frames_needed = round(end_s * self.fps)
            frames = _video().video_frame_count(path, self.fps)
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
        episode = int(self._first.searchsorted(idx, side="right")) - 1
        shift = int(self._shift[episode])
        row = idx + shift  # the frame's row in the cache, and its episode's rows: first..last
        first = int(self._first[episode]) + shift
        last = first + int(self._length[episode]) - 1
        rows_by_key: dict[str, np.ndarray | int] = {}
        for key, offsets in self.delta_indices.items():
            query = row + offsets
            rows_by_key[key] = query.clip(first, last)
            item[f"{key}_is_pad"] = torch.from_numpy((query < first) | (query > last))

        for key, values in self._numeric.items():
            tensor = torch.tensor(values[rows_by_key.get(key, row)])
            item[key] = tensor.float() if tensor.is_floating_point() else tensor
        for key, values in self._strings.items():
            item[key] = values[row].as_py()
        for key, images in self._images.items():
            rows = rows_by_key.get(key)
            frame_rows = np.atleast_1d(row if rows is None else rows)
            frames = _visual_tensor(np.stack([_decode_png(images[int(r)].as_py()) for r in frame_rows]),
                                    self.uint8_visuals)
            item[key] = frames[0] if rows is None else frames
        if self.video_keys:

            def decode(key: str) -> torch.Tensor:
                rows = rows_by_key.get(key)
                frame_rows = np.atleast_1d(row if rows is None else rows)
                path, from_timestamp = self._video_location(key, episode)
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
        item["task"] = self._task_names[int(self._numeric["task_index"][row])]
        return item

    def fingerprint(self) -> str:
        """The dataset revision's hash (:attr:`DatasetMeta.fingerprint`)."""
        return self.meta.fingerprint

    def __getstate__(self) -> dict:
        # Open video containers cannot cross a process boundary (DataLoader workers under spawn).
        state = self.__dict__.copy()
        state["_video_reader"] = self._new_video_reader()
        state["_decode_pool"] = None  # threads do not cross a process boundary either
        for name in ("_numeric", "_images", "_strings"):  # the frame store maps its files again on the other side
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._share_columns()
