"""The per-frame columns a dataset reader reads, memory-mapped from the dataset cache (``lerobot_mg.data.cache``).

The cache entry of a set of columns and data files holds, in the order of the frames' ``index``: one ``.npy`` per
numeric column (``(N, *shape)``), one Arrow IPC file per image (the PNG bytes) or string column, and the episodes
the frames belong to (``episodes.npy``: episode index, first row, length), checked against the episodes table when
the entry is built. Opening an entry maps its files and reads nothing per frame; a selection of episodes is a list
of row ranges of the entry, one per episode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lerobot_mg.data import cache
from lerobot_mg.data.meta import DEFAULT_FEATURES, REDOWNLOAD_ADVICE, read_parquet
from lerobot_mg.errors import ConfigError

logger = logging.getLogger(__name__)


def _column_to_numpy(column: pa.ChunkedArray, shape: tuple[int, ...]) -> np.ndarray:
    """``(N, *shape)`` array from a scalar or (nested, fixed or variable size) list column."""
    array = column.combine_chunks()
    while (
        pa.types.is_list(array.type)
        or pa.types.is_fixed_size_list(array.type)
        or pa.types.is_large_list(array.type)
    ):
        array = array.flatten()
    return _primitive_to_numpy(array).reshape(len(column), *shape)


def _primitive_to_numpy(array: pa.Array) -> np.ndarray:
    """A numeric or boolean array without nulls as numpy, read from its buffers: pyarrow's ``to_numpy`` imports pandas
    (about 0.4 s more start-up in the process that builds the cache entry)."""
    if array.null_count or not (pa.types.is_boolean(array.type) or pa.types.is_integer(array.type)
                                or pa.types.is_floating(array.type)):
        return array.to_numpy(zero_copy_only=False)
    data = np.frombuffer(array.buffers()[1], dtype=np.uint8)
    if pa.types.is_boolean(array.type):  # one bit per value, least significant first
        return np.unpackbits(data, bitorder="little")[array.offset: array.offset + len(array)].astype(bool)
    return data.view(np.dtype(array.type.to_pandas_dtype()))[array.offset: array.offset + len(array)].copy()


def _write_arrow(path: Path, array: pa.Array) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("v", array.type)])) as writer:
        writer.write_batch(pa.record_batch([array], names=["v"]))


def _read_arrow(path: Path) -> pa.Array:
    """The column of ``path``, backed by the memory map (no copy)."""
    return pa.ipc.open_file(pa.memory_map(str(path))).get_batch(0).column(0)


class FrameStore:
    """The columns ``columns`` of the frames in ``data_paths``, memory-mapped; ``features`` gives their dtypes and
    ``lengths()`` the episodes table's frames per episode (read only when the entry is built)."""

    def __init__(self, root: Path, fingerprint: str, features: dict[str, dict], columns: list[str],
                 data_paths: list[Path], lengths: Callable[[], dict[int, int]]) -> None:
        self.root = root
        self.features = features
        self.columns = columns
        files = [{"path": path.relative_to(root).as_posix(), "size": path.stat().st_size,
                  "mtime_ns": path.stat().st_mtime_ns} for path in data_paths]
        key = {"fingerprint": fingerprint, "columns": sorted(columns), "files": files}
        # Named by everything it is built from: copies of the dataset whose files differ in time (two downloads)
        # each get an entry rather than replacing each other's.
        name = f"frames-{cache.digest(key)}"

        def build(folder: Path) -> None:
            self._build(folder, data_paths, lengths())

        with cache.entry(cache.cache_root(fingerprint), name, key, build) as folder:
            self.folder = folder
            self._map()
        # The build's column buffers go back to the system, not to the Arrow allocator's reserve.
        pa.default_memory_pool().release_unused()

    def _map(self) -> None:
        self.numeric: dict[str, np.ndarray] = {}
        self.binary: dict[str, pa.Array] = {}  # image PNG bytes and strings, one value per frame
        for column in self.columns:
            if self._kind(column) == "numeric":
                # A plain ndarray view of the map: np.memmap's own indexing is several times slower per item.
                self.numeric[column] = np.load(self.folder / f"{column}.npy", mmap_mode="r").view(np.ndarray)
            else:
                self.binary[column] = _read_arrow(self.folder / f"{column}.arrow")
        episodes = np.load(self.folder / "episodes.npy", mmap_mode="r")
        self.episode_index, self.episode_row, self.episode_length = (np.array(row) for row in episodes)

    def __getstate__(self) -> dict:
        # A spawned DataLoader worker maps the same files again rather than receiving a copy of the columns.
        return {"root": self.root, "features": self.features, "columns": self.columns, "folder": self.folder}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._map()

    def _kind(self, column: str) -> str:
        dtype = self.features[column]["dtype"]
        return "image" if dtype == "image" else "string" if dtype == "string" else "numeric"

    def _build(self, folder: Path, data_paths: list[Path], lengths: dict[int, int]) -> None:
        """Every column of the data files, one at a time (the memory a build needs is one column's)."""
        order = None
        columns = ["episode_index", *[c for c in self.columns if c != "episode_index"]]
        for number, column in enumerate(columns, 1):
            logger.info("dataset cache: column %d/%d %r of %d data files", number, len(columns), column,
                        len(data_paths))
            parts = [read_parquet(path, [column]).column(0) for path in data_paths]
            values = pa.chunked_array([chunk for part in parts for chunk in part.chunks])
            if order is None:
                index = pa.chunked_array([chunk for path in data_paths
                                          for chunk in read_parquet(path, ["index"]).column(0).chunks])
                order = pc.sort_indices(index)
            values = values.take(order)
            kind = self._kind(column)
            if kind == "image":
                images = values.combine_chunks().field("bytes")
                if images.null_count:
                    raise ConfigError(
                        f"{self.root}: {images.null_count} frames of image feature {column!r} have no embedded "
                        "bytes; this reader needs images embedded in the parquet files. Fix: embed the images "
                        "(LeRobot's writer does) or leave the feature out of policy.observation_keys."
                    )
                _write_arrow(folder / f"{column}.arrow", images.cast(pa.large_binary()))
            elif kind == "string":
                _write_arrow(folder / f"{column}.arrow", values.combine_chunks().cast(pa.large_string()))
            else:
                # Default features are scalars per frame; others keep their declared shape.
                shape = () if column in DEFAULT_FEATURES else tuple(self.features[column]["shape"])
                array = _column_to_numpy(values, shape)
                if column == "episode_index":
                    np.save(folder / "episodes.npy", self._episodes(array, lengths))
                if column in self.columns:
                    np.save(folder / f"{column}.npy", array)
            del parts, values

    def _episodes(self, episode_index: np.ndarray, lengths: dict[int, int]) -> np.ndarray:
        """``(3, E)``: each run of frames of one episode (its index, first row, length), checked against the
        episodes table for the episodes it lists."""
        is_first = np.r_[True, episode_index[1:] != episode_index[:-1]] if len(episode_index) else np.zeros(0, bool)
        starts = np.flatnonzero(is_first)
        runs = np.diff(np.r_[starts, len(episode_index)])
        episodes = episode_index[starts]
        for episode, run in zip(episodes.tolist(), runs.tolist()):
            if episode in lengths and lengths[episode] != run:
                raise ConfigError(
                    f"{self.root}: episode {episode} has {run} frames in the data files but length "
                    f"{lengths[episode]} in the episodes table; the dataset is inconsistent. Fix: {REDOWNLOAD_ADVICE}."
                )
        return np.stack([episodes, starts, runs]).astype(np.int64)

    def rows_of(self, episodes: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(first row, length)`` per episode of ``episodes`` that has frames, in the order of their rows."""
        order = np.argsort(self.episode_index, kind="stable")
        sorted_index = self.episode_index[order]
        wanted = np.asarray(episodes, dtype=np.int64)
        position = np.searchsorted(sorted_index, wanted)
        found = (position < len(sorted_index)) & (sorted_index[np.minimum(position, len(sorted_index) - 1)] == wanted)
        runs = order[position[found]]
        runs.sort()
        return self.episode_row[runs], self.episode_length[runs]
