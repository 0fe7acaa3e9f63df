"""A LeRobot v3.0 dataset's metadata, read once per start: ``meta/info.json`` and the episodes table.

The checks before training (features the policy reads, episode lengths, samples per rank), the policy's input
features, the fingerprint a run records and the dataset reader itself all take one :class:`DatasetMeta`, so a
start opens these files once. The format's constants (paths, the default features) live here for the reader and
the writer alike.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lerobot_mg.data import cache
from lerobot_mg.errors import ConfigError, config_error

CODEBASE_VERSION = "v3.0"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
EPISODES_PATH = EPISODES_DIR + "/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
# Values LeRobot writes into info.json (utils.py: DEFAULT_CHUNK_SIZE, DEFAULT_*_FILE_SIZE_IN_MB).
CHUNKS_SIZE = 1000
DATA_FILES_SIZE_IN_MB = 100
VIDEO_FILES_SIZE_IN_MB = 500
DEFAULT_FEATURES: dict[str, dict] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}



# The config group of the run's one dataset; a mixture's source is given in ``dataset.sources.<i>``.
DATASET_SCOPE = "dataset"

REDOWNLOAD_ADVICE = ("download the dataset again (e.g. `huggingface-cli download --repo-type dataset <repo_id> "
               "--local-dir <root>`) or regenerate it")


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One parquet file (or only ``columns`` of it) as a table. Read through pyarrow's file reader:
    ``pq.read_table`` goes through pyarrow's dataset layer, which imports pandas, about 0.4 s more start-up in every
    process that opens a dataset."""
    return pq.ParquetFile(path).read(columns=columns)


def episode_column(table: pa.Table, name: str) -> np.ndarray:
    """A column of the episodes table (one value per episode) as a numpy array. Converted through Python values:
    pyarrow's ``to_numpy`` imports pandas, about 0.3 s more start-up in every process that opens a dataset."""
    return np.asarray(table.column(name).to_pylist())


def dataset_name(scope: str) -> str:
    """How a message names the dataset given in the config group ``scope``: ``dataset.root`` for the run's one
    dataset (the directory read, wherever it came from), the source's own group (``dataset.sources.<i>``) for a
    mixture's source."""
    return f"{scope}.root" if scope == DATASET_SCOPE else scope


def check_version(info: dict[str, Any], root: Path, scope: str = DATASET_SCOPE) -> None:
    """A ConfigError naming the version of a dataset older than v3.x, and the conversion that fixes it. ``scope``:
    the config group the dataset was given in (``dataset``, or ``dataset.sources.<i>`` for a mixture's source),
    whose keys the message names."""
    version = str(info.get("codebase_version"))
    if not version.startswith("v3."):
        raise config_error(
            f"{scope}.root", str(root), f"is a LeRobot {version} dataset (meta/info.json codebase_version); this "
            "reader reads v3.0 only",
            "convert it with LeRobot's v2.1 -> v3.0 conversion script "
            f"(python -m lerobot.datasets.v30.convert_dataset_v21_to_v30), or {scope}.root=<a v3.0 dataset>",
        )


def read_info(root: Path) -> dict:
    """meta/info.json of a LeRobot v3.x dataset (for tools that need nothing else of it)."""
    info = json.loads((Path(root) / INFO_PATH).read_text())
    check_version(info, Path(root))
    return info


@dataclass(frozen=True)
class DatasetMeta:
    """What a start needs of a dataset before reading any frame, each file read once."""

    root: Path
    info: dict[str, Any]
    # One row per episode, sorted by episode_index, without the per-episode stats columns (large, unused here);
    # memory-mapped from the dataset cache.
    episodes: pa.Table
    # Short stable hash of the dataset revision on disk (not of an episode selection): info.json, stats.json and
    # the episodes table by content, the data and video files by name and size.
    fingerprint: str
    # The config group the dataset was given in: ``dataset``, or ``dataset.sources.<i>`` for a mixture's source.
    # Its user errors (an episode it lacks) name that group's keys.
    scope: str = DATASET_SCOPE

    @classmethod
    def read(cls, root: str | Path, fix: str | None = None, scope: str = DATASET_SCOPE) -> DatasetMeta:
        """Read ``root``'s metadata, given in the config group ``scope`` (``dataset``, or ``dataset.sources.<i>``);
        ``fix`` is the advice when it has no meta/info.json (default: ``<scope>.root=<a dataset directory>``)."""
        root = Path(root)
        if not (root / INFO_PATH).is_file():
            raise config_error(f"{scope}.root", str(root), "is not a LeRobot v3.0 dataset (no meta/info.json), or "
                               "its writer did not finish",
                               fix or f"{scope}.root=<a LeRobot v3.0 dataset directory containing meta/info.json>")
        digest = hashlib.sha256()

        def read_bytes(path: Path) -> bytes:
            data = path.read_bytes()
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(data)
            return data

        info = json.loads(read_bytes(root / INFO_PATH))
        check_version(info, root, scope)
        if (root / STATS_PATH).is_file():
            read_bytes(root / STATS_PATH)
        paths = sorted((root / EPISODES_DIR).glob("chunk-*/file-*.parquet"))
        if not paths:
            raise ConfigError(f"no episodes table under {root / EPISODES_DIR}; the dataset is incomplete. "
                              f"Fix: {REDOWNLOAD_ADVICE}.")
        blobs = [read_bytes(path) for path in paths]
        media = sorted((root / "data").glob("chunk-*/file-*.parquet")) + sorted(
            (root / "videos").glob("*/chunk-*/file-*.mp4"))
        for path in media:
            digest.update(f"{path.relative_to(root).as_posix()}:{path.stat().st_size}".encode())
        fingerprint = digest.hexdigest()[:16]

        def build(folder: Path) -> None:
            tables = []
            for blob in blobs:
                parquet = pq.ParquetFile(pa.BufferReader(blob))
                names = [name for name in parquet.schema_arrow.names if not name.startswith("stats/")]
                tables.append(parquet.read(columns=names))
            table = pa.concat_tables(tables, promote_options="permissive").sort_by("episode_index")
            with pa.OSFile(str(folder / "episodes.arrow"), "wb") as sink:
                with pa.ipc.new_file(sink, table.schema) as writer:
                    writer.write_table(table)

        # Memory-mapped from the dataset cache: the ranks of a machine share one copy of the table.
        with cache.entry(cache.cache_root(fingerprint), "episodes", {"fingerprint": fingerprint}, build) as folder:
            episodes = pa.ipc.open_file(pa.memory_map(str(folder / "episodes.arrow"))).read_all()
        blobs.clear()
        pa.default_memory_pool().release_unused()
        return cls(root, info, episodes, fingerprint, scope)

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.info["features"]

    @property
    def fps(self) -> int:
        return int(self.info["fps"])

    def lengths(self, episodes: list[int] | None = None) -> dict[int, int]:
        """Frames per episode, of ``episodes`` (all when None)."""
        table = self.select(episodes)
        return dict(zip(table.column("episode_index").to_pylist(), table.column("length").to_pylist()))

    def select(self, episodes: list[int] | None) -> pa.Table:
        """The rows of ``episodes`` (all when None); the user error when the dataset lacks one of them."""
        if episodes is None:
            return self.episodes
        available = self.episodes.column("episode_index").to_pylist()
        unknown = sorted(set(episodes) - set(available))
        if unknown:
            key = f"{self.scope}.episodes"
            raise config_error(
                key, list(episodes),
                f"{dataset_name(self.scope)} has no episode {unknown} (it has {len(available)}: "
                f"{min(available)}..{max(available)})",
                f"{key}=<indices in {min(available)}..{max(available)}>, or {key}=null for all",
            )
        # The table's rows of the chosen episodes, in table order, as slices of contiguous runs: a filter or take
        # would convert the indices into an arrow array, and pyarrow imports pandas to convert Python values.
        wanted = set(episodes)
        positions = [position for position, episode in enumerate(available) if episode in wanted]
        runs = [[position for _, position in run]
                for _, run in itertools.groupby(enumerate(positions), key=lambda item: item[1] - item[0])]
        return pa.concat_tables([self.episodes.slice(run[0], len(run)) for run in runs] or [self.episodes.slice(0, 0)])
