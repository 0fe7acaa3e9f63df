"""The training batches: one DataLoader for the whole run, its passes, each batch with its samples' seeds, and a
worker that dies named in the error instead of whatever the pipe to it raised last (a ``ConnectionResetError`` from
a half-received batch, an "exited unexpectedly" without a cause)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lerobot_mg.data.sampler import ResumableBatchSampler, sample_seeds
from lerobot_mg.policies.base import SAMPLE_SEED_KEY

_REAP_WAIT_S = 2.0  # a killed worker's exit status reaches the parent shortly after its pipe breaks


class DataWorkerError(RuntimeError):
    """A DataLoader worker process died; the message names it, how it died and what to do."""


def one_pass(loader: torch.utils.data.DataLoader) -> Iterator[Any]:
    """The batches of one pass over ``loader``; raises ``DataWorkerError`` naming the worker when one died."""
    iterator = iter(loader)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as error:
            dead = _dead_workers(iterator)
            if not dead:
                raise
            raise DataWorkerError(
                "; ".join(dead) + ". The run stops: its batches cannot be delivered in order without that worker. "
                "A worker killed by SIGKILL is most often the kernel's out-of-memory killer (see `dmesg`): lower "
                "num_workers or batch_size, then resume from the last checkpoint (resume=true)."
            ) from error
        yield batch


def _dead_workers(iterator: Iterator[Any]) -> list[str]:
    """'DataLoader worker <i> (pid <pid>) was killed by <signal>' for each worker of ``iterator`` that exited."""
    workers = getattr(iterator, "_workers", [])  # torch's multi-process iterator; none with num_workers=0
    deadline = time.monotonic() + _REAP_WAIT_S
    while workers and not any(worker.exitcode is not None for worker in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    dead = []
    for index, worker in enumerate(workers):
        if worker.exitcode is None:
            continue
        how = (f"was killed by {signal.Signals(-worker.exitcode).name}" if worker.exitcode < 0
               else f"exited with status {worker.exitcode}")
        dead.append(f"DataLoader worker {index} (pid {worker.pid}) {how}")
    return dead


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """A worker ignores SIGINT and SIGTERM: Ctrl-C reaches the terminal's whole process group and torchrun signals
    each rank's process group, but the training process decides when to stop (after a checkpoint, which needs the
    workers' batches until then). A worker still exits when the training process shuts it down or dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Collate:
    """The DataLoader's ``collate_fn``: the dataset's own collate (a mixture pads and normalises its sources per
    batch) or torch's default, then ``prepare`` (e.g. the prompts' tokens:
    ``lerobot_mg.processors.language.worker_language``), in the workers; picklable."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, Any]] | None,
                 prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.collate = collate or torch.utils.data.default_collate
        self.prepare = prepare

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        batch = self.collate(items)
        return batch if self.prepare is None else self.prepare(batch)


def endless_batches(dataset: torch.utils.data.Dataset, sampler: ResumableBatchSampler, num_workers: int,
                    pin_memory: bool, prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                    ) -> Iterator[dict[str, Any]]:
    """Endless batches, each with its samples' seeds; one DataLoader pass per epoch, starting at the sampler's
    saved position. ``prepare``, if given, finishes each collated batch in the workers (see :class:`Collate`).

    One DataLoader for the whole run: its workers persist from one epoch to the next, with their open video files
    (a new pass otherwise forks new workers, which reopen every file and leave the loop waiting at each epoch's
    start). It has a generator of its own: a DataLoader otherwise draws its worker seed from the global RNG when an
    iterator starts, and a resumed run (which starts one mid-epoch) would drift from a straight one.
    """
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, persistent_workers=num_workers > 0,
        collate_fn=Collate(getattr(dataset, "collate", None), prepare),
        pin_memory=pin_memory, worker_init_fn=_leave_stop_signals_to_the_trainer,
        generator=torch.Generator().manual_seed(sampler.seed * 100_003 + sampler.epoch),
    )
    while True:
        epoch = sampler.epoch  # the sampler reads its position when the pass starts, as here
        for batch in one_pass(loader):  # a worker that dies is named in the error
            yield {**batch, SAMPLE_SEED_KEY: sample_seeds(sampler.seed, epoch, batch["index"])}
