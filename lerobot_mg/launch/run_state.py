"""What one ``train()`` call leaves in its process, and how it is torn down so the next call starts clean.

A local Hydra sweep runs every point in one Python process, one after another. Each run creates process-wide
state that would leak into the next point: the default process group, accelerate's shared ``PartialState`` /
``AcceleratorState`` / ``GradientState`` (a second ``Accelerator`` with another precision refuses to build; the
CPU rehearsal relabels the shared distributed type), environment variables accelerate writes (our environment
guard would refuse the next run because of them), a background checkpoint writer still writing when the run
failed (its save is completed, then the thread stops), a wandb or trackio run still open after a failure, this
run's log file handler, and the signal handlers of the stop watch (SIGINT, SIGTERM, preemption).
:func:`releases_run_state` tears all of it down when ``train()`` returns or raises; every run seeds its RNGs itself
at start.

The order matters for the process groups: the run's objects (the DDP wrapper and its C++ reducer, FSDP's modules,
the optimizer) are freed first, while every group they hold is still alive, and only then are the groups destroyed.
A gloo group's destructor joins its worker threads; if the last reference to a group were DDP's reducer, that
join would run under the GIL, and a worker thread still releasing the tensors of a finished collective needs the
GIL: the process would hang at exit, now and then (see pytorch/pytorch#56297).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState

from lerobot_mg.checkpoint.manager import release_background_writers
from lerobot_mg.launch.preemption import uninstall_watches

RUN_LOG_FILENAME = "train.log"

P = ParamSpec("P")
R = TypeVar("R")


class RunLogHandler(logging.FileHandler):
    """``<run dir>/train.log``: the run's log records, written by the main process only (appended on resume)."""


def attach_run_log(output_dir: Path, is_main: bool) -> None:
    """Send this run's log records to ``train.log`` in its run directory (main process only)."""
    if not is_main:
        return
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    handler = RunLogHandler(Path(output_dir) / RUN_LOG_FILENAME, delay=True)  # no file until something is logged
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)


def _detach_run_logs() -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, RunLogHandler)]:
        root.removeHandler(handler)
        handler.close()


def _finish_wandb() -> None:
    wandb = sys.modules.get("wandb")  # only if a run imported it
    if wandb is not None and wandb.run is not None:
        wandb.run.finish(exit_code=1)  # a run that raised before closing its tracker


def _finish_trackio() -> None:
    trackio = sys.modules.get("trackio")  # only if a run imported it (the `trackio` extra)
    if trackio is not None and trackio.context_vars.current_run.get() is not None:
        trackio.finish()  # a run that raised before closing its tracker


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _restore_environ(before: dict[str, str]) -> None:
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _free_run_objects(error: BaseException | None) -> None:
    # A failed train()'s frames keep its model, optimizer and reducer alive through the traceback: drop their
    # locals (the traceback still prints), then the reference cycles among the run's objects.
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    gc.collect()


def release_run_state(environ_before: dict[str, str], error: BaseException | None = None) -> None:
    """Tear down everything a run set up in this process (see the module docstring). Safe to call after a
    run that failed anywhere (``error``: what it raised), and when nothing was set up."""
    uninstall_watches()  # the stop watch's handlers: put back the ones it replaced (submitit's, or the defaults)
    release_background_writers()  # first: the failed run's managers are only weakly held; a DCP write uses a group
    _free_run_objects(error)  # while the process groups they hold are alive
    _finish_wandb()
    _finish_trackio()
    _detach_run_logs()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # every group, the default one included
    _reset_accelerate()
    _restore_environ(environ_before)


def releases_run_state(train_fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate ``train``: each call, returning or raising, leaves the process as it found it."""

    @functools.wraps(train_fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        environ_before = dict(os.environ)
        # What this process held before the run (the imported modules, the composed config) is not the run's:
        # frozen, it is left out of the collections, the teardown's included, which then cost what the run made.
        gc.freeze()
        try:
            result = train_fn(*args, **kwargs)
        except BaseException as error:
            release_run_state(environ_before, error)
            raise
        release_run_state(environ_before)
        return result

    return wrapper
