"""A data-parallel batch sampler whose position survives a resume, even on another topology.

Each epoch is one permutation of the dataset, drawn from a generator seeded by (seed, epoch) only:
the *global* stream. Loop step ``k`` of an epoch consumes the window of ``G = batch_size *
world_size`` positions starting at ``offset + k * G``, and rank ``r`` takes the ``r``-th contiguous
``batch_size`` slice of it. Two runs with the same ``G`` therefore see the same global batches
whatever their split into (batch_size, world_size), and the saved state is just (epoch, offset).

Every rank of a run draws the same permutation; for a large dataset (``MAP_PERMUTATION_FROM`` samples or more,
given a ``cache_dir``) it is written once per machine into the dataset cache (``lerobot_mg.data.cache``) and
memory-mapped, so that the ranks of a node share one copy instead of holding 8 bytes a sample each.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from lerobot_mg.data import cache
from lerobot_mg.errors import ConfigError, config_error

MAP_PERMUTATION_FROM = 1 << 20  # samples: below, a permutation (8 MiB at most) stays in the rank's memory


def sample_seeds(seed: int, epoch: int, indices: torch.Tensor) -> torch.Tensor:
    """One int64 seed per sample presentation, from (run seed, epoch, dataset index) only.

    Each epoch presents a sample at most once (a dataset mixture that draws a frame again in an epoch gives that
    presentation another index: ``lerobot_mg.data.mixture``), so the seed is unique to a presentation yet
    independent of the rank, the micro-batch and the process count that carry it: per-sample training noise drawn
    from it is the same on every layout and after a resume.
    """
    return torch.tensor(
        [
            int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)
            for index in indices.tolist()
        ],
        dtype=torch.int64,
    )


def release_freed_memory() -> None:
    """Hand the memory freed so far back to the system (glibc's ``malloc_trim``): the allocator otherwise keeps the
    freed blocks below its (growing) mmap threshold, private to the process, for good. Nothing where there is no
    glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ResumableBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's micro-batch indices for each remaining loop step of the current epoch.

    Iterating does not move the position (DataLoader workers prefetch ahead of the loop): the loop
    calls ``advance()`` once per step it has consumed, which rolls over to the next epoch at the end.
    The last ``num_samples % G`` positions of each permutation are dropped (drop_last).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        cache_dir: Path | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r}: must be at least 1. Fix: batch_size=8")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank} and world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size."
            )
        global_batch_size = batch_size * world_size
        if num_samples < global_batch_size:
            raise ConfigError(
                f"batch_size={batch_size}: the dataset has {num_samples} samples, fewer than one global batch of "
                f"batch_size={batch_size} x world size {world_size} = {global_batch_size}. Fix: "
                f"batch_size={max(num_samples // world_size, 1)} or fewer processes."
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.cache_dir = cache_dir if cache_dir is not None and num_samples >= MAP_PERMUTATION_FROM else None
        self.global_batch_size = global_batch_size
        self.num_steps_per_epoch = num_samples // global_batch_size
        self.epoch = 0
        self.offset = 0
        self._cached_epoch: int | None = None
        self._cached_permutation = torch.empty(0, dtype=torch.int64)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The global order of sample indices for ``epoch``, a function of (seed, epoch) only."""
        if self._cached_epoch != epoch:
            self._cached_permutation = torch.empty(0, dtype=torch.int64)  # the previous epoch's goes first
            if not self.shuffle:
                self._cached_permutation = torch.arange(self.num_samples)
            elif self.cache_dir is None:
                self._cached_permutation = self._draw(epoch)
            else:
                self._cached_permutation = self._mapped(epoch)
            self._cached_epoch = epoch
        return self._cached_permutation

    def _draw(self, epoch: int) -> torch.Tensor:
        # SeedSequence mixes (seed, epoch) so that e.g. (0, 1) and (1, 0) give unrelated streams.
        mixed_seed = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1, dtype=np.uint64)[0])
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(mixed_seed))

    def _mapped(self, epoch: int) -> torch.Tensor:
        """The permutation of ``epoch`` from the cache (drawn and written by the first process to ask, or by several
        at once: one publishes, see ``lerobot_mg.data.cache``), memory-mapped; entries of epochs two or more behind
        are removed (those of other seeds and dataset sizes go with the cache's retention rule)."""
        assert self.cache_dir is not None
        prefix = f"permutation-s{self.seed}-n{self.num_samples}-e"
        key = {"seed": self.seed, "epoch": epoch, "num_samples": self.num_samples}
        with cache.entry(self.cache_dir, f"{prefix}{epoch}", key,
                         lambda folder: np.save(folder / "permutation.npy", self._draw(epoch).numpy())) as folder:
            # Copy-on-write: writable for torch, yet the pages stay the shared ones (nothing writes to them).
            permutation = torch.from_numpy(np.load(folder / "permutation.npy", mmap_mode="c"))
        for old in self.cache_dir.glob(f"{prefix}*"):
            old_epoch = old.name[len(prefix):]
            if old_epoch.isdigit() and int(old_epoch) < epoch - 1:
                cache.discard(old)
        release_freed_memory()  # a draw's temporaries: tens of MiB the allocator would otherwise keep per rank
        return permutation

    def _batch_at(self, epoch: int, window_start: int) -> list[int]:
        start = window_start + self.rank * self.batch_size
        return self.permutation(epoch)[start : start + self.batch_size].tolist()

    def __len__(self) -> int:
        return (self.num_samples - self.offset) // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        # The position is read when iteration starts, not when the first batch is drawn.
        return self._iterate(self.epoch, self.offset, len(self))

    def _iterate(self, epoch: int, offset: int, num_steps: int) -> Iterator[list[int]]:
        for step in range(num_steps):
            yield self._batch_at(epoch, offset + step * self.global_batch_size)

    def advance(self, num_steps: int = 1) -> None:
        if num_steps < 0:
            raise ValueError(f"advance(num_steps={num_steps}) cannot go backwards.")
        for _ in range(num_steps):
            self.offset += self.global_batch_size
            if self.offset + self.global_batch_size > self.num_samples:
                self.epoch += 1
                self.offset = 0

    def state_dict(self) -> dict[str, int]:
        """The position in the global stream, and what makes the stream (how it is split is the run's business:
        ``RunFacts.batch`` records it, and ``Continuation.of_resume`` judges a change)."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> str:
        """Continue at the saved epoch and global sample offset; returns the position, for the log."""
        if state["num_samples"] != self.num_samples:
            raise ConfigError(
                f"dataset.episodes: this run's dataset has {self.num_samples} samples, but the sampler state was "
                f"saved for a dataset of {state['num_samples']} samples. Fix: resume with the saved run's dataset "
                "(dataset.repo_id, dataset.root) and dataset.episodes"
            )
        if state["seed"] != self.seed:
            raise config_error("seed", self.seed, f"the sampler state was saved with seed={state['seed']}",
                               f"seed={state['seed']}, to continue the same sample order")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        position = f"epoch {self.epoch}, sample offset {self.offset}"
        if self.offset + self.global_batch_size > self.num_samples:
            # Fewer samples left than one new global batch: this epoch has no step left.
            self.epoch, self.offset = self.epoch + 1, 0
            position += f" (too few samples remained for one global batch: continuing at epoch {self.epoch}, offset 0)"
        return position
