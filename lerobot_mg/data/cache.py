"""The dataset cache: what a run reads of a dataset, as files every process of a machine memory-maps.

A rank that held its dataset's columns in its own memory would hold them once per rank (and the DataLoader
workers' copy-on-write pages drift apart as Python touches reference counts): for a 20M-frame dataset, gigabytes
per rank. Instead the columns a run reads, the episodes table and the sampler's permutations are written once per
dataset and machine as plain files (numpy ``.npy``, Arrow IPC) and memory-mapped read-only: the page cache holds
one copy that every rank and worker of the machine shares.

Where: ``<dataset root>/.lerobot_mg_cache`` when the dataset's folder is writable, else
``$LEROBOT_MG_CACHE/dataset_cache/<dataset name>-<hash of its path>`` (``$LEROBOT_MG_CACHE`` defaults to
``~/.cache/lerobot_mg``); a dataset shipped inside the package (the PushT slice) always takes the latter: the
installed package's files are the installer's, and the next install would remove a cache written among them. Deleting the folder is always safe: the next start writes it again.

Each entry is a folder with a ``manifest.json`` that records what it was built from (its key: the dataset's
fingerprint, the columns, the data files' sizes and modification times) and the size of every file in it. Entries
are built into a temporary folder and renamed into place while holding a file lock, so ranks of one machine that
start together build an entry once and the others wait for it. An entry whose key no longer matches the dataset
(the dataset changed: stale) or whose files are missing or have another size (truncated) is rebuilt, with a
warning; it is never read.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CACHE_DIRNAME = ".lerobot_mg_cache"
_PACKAGE = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class StaleCacheWarning(UserWarning):
    """A cache entry did not match its dataset (stale or truncated) and was rebuilt."""


def user_cache_dir() -> Path:
    """``$LEROBOT_MG_CACHE``, else ``~/.cache/lerobot_mg`` (where the embedded datasets are generated too)."""
    return Path(os.environ.get("LEROBOT_MG_CACHE") or Path.home() / ".cache" / "lerobot_mg")


def cache_root(dataset_root: Path) -> Path:
    """The cache folder of ``dataset_root`` (created): next to the dataset when that folder is writable and not part
    of the installed package, else under the user cache folder."""
    dataset_root = Path(dataset_root).resolve()
    local = dataset_root / CACHE_DIRNAME
    shipped = _PACKAGE in dataset_root.parents
    if not shipped and local.is_dir() and os.access(local, os.W_OK):
        return local
    if not shipped and os.access(dataset_root, os.W_OK):
        try:
            local.mkdir(exist_ok=True)
            return local
        except OSError:
            pass
    name = hashlib.sha256(str(dataset_root).encode()).hexdigest()[:16]
    fallback = user_cache_dir() / "dataset_cache" / f"{dataset_root.name}-{name}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def digest(value: Any) -> str:
    """A short stable hash of a JSON-able value (names cache entries by what they hold)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created), shared by every process of the machine."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _problem(entry: Path, key: dict[str, Any]) -> str | None:
    """Why ``entry`` cannot be read (None when it can): absent (""), stale or truncated."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError):
        return "its manifest is unreadable"
    if manifest.get("format") != FORMAT_VERSION or manifest.get("key") != key:
        return "it was built from another revision of the dataset (stale)"
    for name, size in manifest.get("files", {}).items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing (truncated)"
        if path.stat().st_size != size:
            return f"{name} holds {path.stat().st_size} bytes, not {size} (truncated)"
    return None


@contextmanager
def entry(root: Path, name: str, key: dict[str, Any], build: Callable[[Path], None]) -> Iterator[Path]:
    """The folder ``root/name`` valid for ``key``, built by ``build(folder)`` when missing, stale or truncated.

    Held under the entry's lock while the caller opens its files (a rebuild elsewhere then cannot remove them
    between the check and the open; an open memory map outlives a later removal).
    """
    folder = root / name
    with file_lock(root / f"{name}.lock"):
        problem = _problem(folder, key)
        if problem is not None:
            if problem:
                warnings.warn(f"the dataset cache {folder} is not read: {problem}; rebuilding it",
                              StaleCacheWarning, stacklevel=3)
            building = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=root))
            try:
                build(building)
                files = {path.name: path.stat().st_size for path in building.iterdir()}
                manifest = {"format": FORMAT_VERSION, "key": key, "files": files}
                (building / MANIFEST).write_text(json.dumps(manifest, indent=1))
                if folder.exists():
                    old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=root))
                    os.replace(folder, old / name)
                    shutil.rmtree(old, ignore_errors=True)
                os.replace(building, folder)
            finally:
                shutil.rmtree(building, ignore_errors=True)
        yield folder


def remove(path: Path) -> None:
    """Remove an entry or its lock file (best effort: another process may be removing it too)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
