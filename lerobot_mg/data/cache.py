"""The dataset cache: what a run reads of a dataset, as files every process of a machine memory-maps.

A rank that held its dataset's columns in its own memory would hold them once per rank (and the DataLoader
workers' copy-on-write pages drift apart as Python touches reference counts): for a 20M-frame dataset, gigabytes
per rank. Instead the columns a run reads, the episodes table and the sampler's permutations are written once per
dataset as plain files (numpy ``.npy``, Arrow IPC) and memory-mapped read-only: the page cache holds one copy that
every rank and worker of a machine shares.

Where: ``$LEROBOT_MG_DATASET_CACHE/<fingerprint>/``, by default ``$LEROBOT_MG_CACHE/datasets-cache/<fingerprint>/``
(``$LEROBOT_MG_CACHE`` defaults to ``~/.cache/lerobot_mg``; its ``datasets/`` folder holds the generated embedded
datasets). Never inside the dataset's folder: the dataset stays what was downloaded (a later upload does not carry
the cache), a read-only or shipped dataset caches like any other, and copies of one dataset revision at different
paths share one cache. Deleting the folder is always safe: the next start writes it again.

Each entry is a folder with a ``manifest.json`` that records what it was built from (its key) and the size of every
file in it. An entry is built into a private temporary folder (``.<entry>.building-<host>-<pid>-<random>``) and
published by one atomic rename: when two processes build the same entry at once (two nodes on a shared file system,
whatever their locks do), the first rename wins and the other process reads the winner's entry and discards its
own. A lock per entry (``flock`` on one of 256 lock files in ``locks/``, never deleted) only spares the ranks of a
machine the duplicate work where the file system supports it; correctness never depends on it. An entry whose key
does not match (stale) or whose files are missing or have another size (truncated) is rebuilt, with a warning; it is
never read.

Kept bounded by :func:`clean` (every start, in the preflight): an entry no start has opened for
``$LEROBOT_MG_CACHE_DAYS`` days (30 by default) is removed, and so is a temporary folder left by a killed build (at
once when its process is known dead on this machine, else after a day without a write). The sampler keeps the
permutations of the current and previous epoch only.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lerobot_mg.errors import config_error

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "LEROBOT_MG_DATASET_CACHE"
KEEP_DAYS_ENV = "LEROBOT_MG_CACHE_DAYS"
DEFAULT_KEEP_DAYS = 30.0
ABANDONED_AFTER_S = 24 * 3600  # a temporary folder of another machine nothing wrote to for a day
MANIFEST = "manifest.json"
FORMAT_VERSION = 2
LOCKS_DIR = "locks"
LOCK_BUCKETS = 256
# A build's or a removal's temporary folder: .<entry>.building-<host>-<pid>-<random> / .<entry>.old-<...>
_TEMPORARY = re.compile(r"^\.(?P<entry>.+?)\.(?P<kind>building|old)-(?P<host>.+)-(?P<pid>\d+)-(?P<random>[^-]+)$")
# What flock raises on a file system that does not support it (Lustre without -o flock, some NFS mounts).
_NO_LOCKING = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP}


class StaleCacheWarning(UserWarning):
    """A cache entry did not match its dataset (stale or truncated) and was rebuilt."""


def user_cache_dir() -> Path:
    """``$LEROBOT_MG_CACHE``, else ``~/.cache/lerobot_mg`` (where the embedded datasets are generated too)."""
    return Path(os.environ.get("LEROBOT_MG_CACHE") or Path.home() / ".cache" / "lerobot_mg")


def datasets_cache_dir() -> Path:
    """The dataset cache: ``$LEROBOT_MG_DATASET_CACHE``, else ``$LEROBOT_MG_CACHE/datasets-cache``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    return Path(explicit).expanduser() if explicit else user_cache_dir() / "datasets-cache"


def cache_root(fingerprint: str) -> Path:
    """The cache folder of the dataset revision ``fingerprint`` (created)."""
    root = datasets_cache_dir() / fingerprint
    root.mkdir(parents=True, exist_ok=True)
    return root


def keep_days(env: Mapping[str, str] | None = None) -> float:
    """Days an entry stays without a start opening it: ``$LEROBOT_MG_CACHE_DAYS``, else 30."""
    value = (os.environ if env is None else env).get(KEEP_DAYS_ENV)
    if not value:
        return DEFAULT_KEEP_DAYS
    try:
        days = float(value)
    except ValueError:
        days = 0.0
    if days <= 0:
        raise config_error(KEEP_DAYS_ENV, value, "must be a positive number of days (how long an unused dataset "
                           "cache entry is kept)", f"export {KEEP_DAYS_ENV}={DEFAULT_KEEP_DAYS:g}")
    return days


def digest(value: Any) -> str:
    """A short stable hash of a JSON-able value (names cache entries by what they hold)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def machine_lock(root: Path, name: str) -> Iterator[bool]:
    """An exclusive ``flock`` shared by the processes of a machine that build or remove ``root/name``; yields whether
    it holds one. The lock files (one of ``LOCK_BUCKETS`` beside the fingerprint folders) are never deleted: a
    process may hold one at any time. Where the file system refuses ``flock``, nothing is locked: the atomic
    publication of :func:`entry` keeps the cache correct without it."""
    locks = root.parent / LOCKS_DIR
    locks.mkdir(parents=True, exist_ok=True)
    bucket = int(hashlib.sha256(f"{root.name}/{name}".encode()).hexdigest()[:8], 16) % LOCK_BUCKETS
    with open(locks / f"{bucket:02x}.lock", "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in _NO_LOCKING:
                raise
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _problem(entry: Path, key: dict[str, Any]) -> str | None:
    """Why ``entry`` cannot be read (None when it can): absent (""), stale or truncated."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except (OSError, ValueError):
        return "its manifest is unreadable"
    if manifest.get("format") != FORMAT_VERSION or manifest.get("key") != key:
        return "its key does not match what this run reads (stale)"
    for name, size in manifest.get("files", {}).items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing (truncated)"
        if path.stat().st_size != size:
            return f"{name} holds {path.stat().st_size} bytes, not {size} (truncated)"
    return None


def _temporary(root: Path, name: str, kind: str) -> Path:
    """A new private folder ``.<name>.<kind>-<host>-<pid>-<random>`` in ``root``."""
    root.mkdir(parents=True, exist_ok=True)  # a clean elsewhere may have removed an empty fingerprint folder
    return Path(tempfile.mkdtemp(prefix=f".{name}.{kind}-{socket.gethostname()}-{os.getpid()}-", dir=root))


def discard(folder: Path) -> None:
    """Remove an entry: renamed out of its name first (a reader never sees a half-removed entry), then deleted.
    Another process removing it at the same time is no error."""
    aside = _temporary(folder.parent, folder.name, "old")
    try:
        os.rename(folder, aside / folder.name)
    except FileNotFoundError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _publish(building: Path, folder: Path, key: dict[str, Any]) -> bool:
    """Rename the built ``building`` to ``folder``; False when another process published a valid entry there first
    (the caller reads theirs). An invalid entry in the way is moved aside first."""
    for _ in range(8):
        try:
            os.rename(building, folder)  # atomic; refused while a non-empty folder has the name
            return True
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if _problem(folder, key) is None:
            return False  # another process won: its entry is as good as ours
        aside = _temporary(folder.parent, folder.name, "old")
        try:
            os.rename(folder, aside / folder.name)
        except FileNotFoundError:
            pass  # another process moved it first
        else:
            # Between the check and the move another process may have published a valid entry: put it back.
            if _problem(aside / folder.name, key) is None:
                try:
                    os.rename(aside / folder.name, folder)
                    shutil.rmtree(aside, ignore_errors=True)
                    return False
                except OSError:
                    pass
        shutil.rmtree(aside, ignore_errors=True)
    raise RuntimeError(f"{folder}: could not be published after 8 tries; other processes keep replacing it")


def _mark_used(folder: Path) -> None:
    """Record that a start opened ``folder`` (its manifest's modification time), for :func:`clean`."""
    try:
        os.utime(folder / MANIFEST)
    except OSError:
        pass  # a read-only cache: nothing will clean it either


@contextmanager
def entry(root: Path, name: str, key: dict[str, Any], build: Callable[[Path], None]) -> Iterator[Path]:
    """The folder ``root/name`` valid for ``key``, built by ``build(folder)`` when missing, stale or truncated.

    The caller opens its files inside the ``with``: on a machine whose file system supports ``flock`` the entry's
    lock is held meanwhile, so a removal there waits (an open memory map outlives a later removal).
    """
    folder = root / name
    with machine_lock(root, name):
        problem = _problem(folder, key)
        if problem is not None:
            if problem:
                warnings.warn(f"the dataset cache {folder} is not read: {problem}; rebuilding it",
                              StaleCacheWarning, stacklevel=3)
            started = time.monotonic()
            logger.info("dataset cache: building %s", folder)
            building = _temporary(root, name, "building")
            try:
                build(building)
                for path in building.iterdir():  # on disk before it is published: a crash cannot leave a
                    fsync(path)  # published entry half written
                files = {path.name: path.stat().st_size for path in building.iterdir()}
                manifest = {"format": FORMAT_VERSION, "key": key, "files": files}
                (building / MANIFEST).write_text(json.dumps(manifest, indent=1))
                won = _publish(building, folder, key)
            finally:
                shutil.rmtree(building, ignore_errors=True)
            logger.info("dataset cache: %s %s in %.1f s", "built" if won else "another process built", folder,
                        time.monotonic() - started)
        _mark_used(folder)
        yield folder


def fsync(path: Path) -> None:
    """Flush ``path`` to disk: a file's contents, or a directory's entries (a rename into it)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@dataclass(frozen=True)
class Cleaned:
    """What :func:`clean` removed: entries unused for the retention period, and abandoned temporary folders."""

    unused: tuple[Path, ...]
    abandoned: tuple[Path, ...]


def _abandoned(folder: Path, now: float) -> bool:
    """A build's or removal's temporary folder whose process is gone: known dead on this machine, or nothing in it
    written for ``ABANDONED_AFTER_S``."""
    match = _TEMPORARY.match(folder.name)
    if match is None:
        return False
    if match["host"] == socket.gethostname():
        try:
            os.kill(int(match["pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
    try:
        newest = max([folder.stat().st_mtime, *(path.stat().st_mtime for path in folder.rglob("*"))])
    except FileNotFoundError:
        return False  # being removed or published right now
    return now - newest > ABANDONED_AFTER_S


def _last_used(folder: Path) -> float | None:
    """When a start last opened the entry ``folder`` (its manifest's modification time), or None when it has no
    manifest (then the folder's own)."""
    try:
        return (folder / MANIFEST).stat().st_mtime
    except FileNotFoundError:
        try:
            return folder.stat().st_mtime
        except FileNotFoundError:
            return None


def clean(days: float | None = None, now: float | None = None) -> Cleaned:
    """Remove, across the whole dataset cache, the entries no start opened for ``days`` (``keep_days()``), the
    temporary folders of killed builds and fingerprint folders left empty. Lock files stay. Safe while other
    processes use the cache: an entry opened within the period is kept, and a removal renames before it deletes."""
    days = keep_days() if days is None else days
    now = time.time() if now is None else now
    base = datasets_cache_dir()
    unused: list[Path] = []
    abandoned: list[Path] = []
    if not base.is_dir():
        return Cleaned((), ())
    for root in sorted(base.iterdir()):
        if root.name == LOCKS_DIR or not root.is_dir():
            continue
        for item in sorted(root.iterdir()):
            if item.name.startswith("."):
                if item.is_dir() and _abandoned(item, now):
                    shutil.rmtree(item, ignore_errors=True)
                    abandoned.append(item)
                continue
            used = _last_used(item)
            if used is None or now - used <= days * 86400:
                continue
            with machine_lock(root, item.name):
                used = _last_used(item)  # a start may have opened it while this one waited
                if used is not None and now - used > days * 86400:
                    discard(item)
                    unused.append(item)
        try:
            if now - root.stat().st_mtime > days * 86400:
                root.rmdir()  # only when empty; a start creates its entries afresh
        except OSError:
            pass
    return Cleaned(tuple(unused), tuple(abandoned))
