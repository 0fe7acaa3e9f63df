"""Paths read from a file that someone else may have written, kept inside the folder the file came with.

A checkpoint, a processor manifest or a dataset's ``info.json`` names other files by relative paths: DCP's
``relative_path`` of each shard, a processor step's ``state_file``, the dataset's ``data_path`` and ``video_path``
templates, an adapter's local base. Joined as they are, a downloaded file could name ``/etc/shadow``,
``../../.ssh/id_rsa``, a symlink to either, or a FIFO that blocks the reader forever. :func:`contained` is the one
check every such path goes through: it returns the path only when it names a regular file (or nothing yet) inside
the root, and otherwise raises :class:`UnsafePath`, one line naming the file that held the path and its key.

A Hugging Face Hub cache snapshot (``.../models--<user>--<name>/snapshots/<commit>/``) holds its files as symlinks
into the repo's own ``blobs/`` folder; those links are the cache's layout, and count as inside the root.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from lerobot_mg.errors import ConfigError

TRUSTED_SOURCE_FIX = "use a copy from a source you trust, or correct the entry to a path inside its folder"


class RefusedFile(ConfigError):
    """A file from someone else that this package will not read as it stands (a pickle that could run code, an
    archive entry that would inflate, a path out of its folder). One line, naming the file; nothing of it was read
    or run."""


class UnsafePath(RefusedFile):
    """A path read from a file that leaves the folder the file came with, or names something that is not a regular
    file."""


def _hub_blobs(root: Path) -> Path | None:
    """The ``blobs/`` folder of the Hub cache repo whose snapshot holds ``root`` (lexically), or None."""
    for folder in (root, *root.parents):
        if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
            return folder.parent.parent / "blobs"
    return None


def _problem(stored: object) -> str | None:
    """Why ``stored`` is no relative path that stays in its folder, read as text only (nothing on disk), or None."""
    if not isinstance(stored, str) or not stored:
        return "is not a relative file path"
    if "\0" in stored:
        return "holds a NUL character"
    if stored.startswith(("/", "\\")) or PurePosixPath(stored).is_absolute() or PureWindowsPath(stored).drive:
        return "is an absolute path"
    if ".." in PurePosixPath(stored.replace("\\", "/")).parts:
        return "climbs out of its folder with '..'"
    return None


def contained(root: Path | str, stored: object, source: Path | str, key: str,
              fix: str = TRUSTED_SOURCE_FIX, folder: bool = False) -> Path:
    """``root / stored``, for a ``stored`` path read from the file ``source`` under ``key``, once it is known to stay
    in ``root``: a relative path without ``..``, that resolves (through any symlink) inside ``root`` (or the Hub
    cache's blobs of the snapshot ``root`` is in), and that names a regular file (a directory, with ``folder``) when
    something exists there.
    A path that exists nowhere yet is returned as it is: the caller reports a missing file in its own words.
    Raises :class:`UnsafePath`, naming ``source``, ``key`` and ``stored``, otherwise."""
    root = Path(root)
    problem = _problem(stored)
    path = root / str(stored)
    if problem is None:
        real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
        blobs = _hub_blobs(Path(os.path.abspath(root)))
        inside = real.is_relative_to(real_root) or (blobs is not None and real.parent == Path(os.path.realpath(blobs)))
        if not inside:
            problem = f"leads out of {root} through a symlink (to {real})"
        else:
            try:
                mode = os.stat(real).st_mode
            except FileNotFoundError:
                return path
            if folder and not stat.S_ISDIR(mode):
                problem = "is not a directory"
            elif not folder and not stat.S_ISREG(mode):
                problem = "is not a regular file"
    if problem is None:
        return path
    kind = "a directory" if folder else "a regular file"
    raise UnsafePath(f"{source}: {key}={stored!r} {problem}: a path read from a file must name {kind} inside "
                     f"{root}, so nothing was read from it. Fix: {fix}")
