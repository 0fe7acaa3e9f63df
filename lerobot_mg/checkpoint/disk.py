"""A checkpoint that the disk refuses (full, over quota, read-only, no permission) stops the run with a ConfigError
that names the path, the bytes the save needs and whether the previous checkpoint is intact, instead of a traceback.

The machine's state is not a bug: the user frees space, fixes the permissions or picks another output_dir. A save
that cannot fit is refused before any of it is written; a write that fails anyway removes the partial save.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.checkpoint import CheckpointException

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.errors import ConfigError

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


def disk_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed write when it is one of ``DISK_ERRNOS`` (DCP wraps each rank's error in a
    CheckpointException; safetensors raises its own type with the OS message)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_ERRNOS:
            return seen
        if isinstance(seen, CheckpointException):
            for failure in seen.failures.values():
                found = disk_error(getattr(failure, "exc", failure))
                if found is not None:
                    return found
        if isinstance(seen, SafetensorError):
            for number in DISK_ERRNOS:
                if os.strerror(number) in str(seen):
                    return OSError(number, str(seen))
        seen = seen.__cause__ or seen.__context__
    return None


class DiskGuard:
    """The disk checks of one run's saves under ``root`` (its checkpoints directory)."""

    def __init__(self, root: Path, dims: ParallelDims):
        self.root = root
        self.dims = dims
        self.needed_bytes = 0  # what the save being written needs on this rank (its tensors' bytes)

    def check_free_space(self, tmp: Path, needed: int) -> None:
        """Refuse a save that cannot fit before writing any of it. Collective: every rank calls it (each checks
        its own share; all stop together).

        The ranks agree through an object collective, which torch runs on a device the group serves (the CPU on
        our ``cuda:nccl,cpu:gloo`` group, the GPU on a plain NCCL one): valid whatever backends the group maps.
        """
        self.needed_bytes = needed
        free = shutil.disk_usage(tmp).free
        shortfalls = [needed if needed > free else 0]
        if self.dims.is_distributed:
            shortfalls = [None] * self.dims.world_size
            dist.all_gather_object(shortfalls, needed if needed > free else 0)
        short = max(shortfalls)
        if short > 0:
            if self.dims.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(self._message(tmp, f"{free:,} bytes free on its file system", short))

    @contextmanager
    def errors(self, tmp: Path) -> Iterator[None]:
        """A full or read-only disk becomes a ConfigError naming the path and the bytes; other errors pass."""
        try:
            yield
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            cause = disk_error(error)
            if cause is None:
                raise
            if self.dims.is_main_process:  # a partial checkpoint is no use; free what it took
                shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(self._message(tmp, str(cause), self.needed_bytes)) from error

    def _message(self, tmp: Path, problem: str, needed: int) -> str:
        last = self.root / L.LAST_LINK
        previous = f"the previous checkpoint {last.resolve()} is intact" if last.exists() else "no earlier checkpoint"
        return (f"could not write checkpoint {tmp}: {problem}; it needs about {needed:,} bytes on this rank; "
                f"{previous}. Fix: free space (or fix the permissions) under {self.root}, or resume into another "
                "output_dir")


def tree_bytes(directory: Path) -> int:
    """Bytes of the files under ``directory``."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
