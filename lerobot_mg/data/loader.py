"""The training DataLoader's passes, with a worker that dies named in the error instead of whatever the pipe to it
raised last (a ``ConnectionResetError`` from a half-received batch, an "exited unexpectedly" without a cause)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import torch

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
