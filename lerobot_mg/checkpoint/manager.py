"""Saving and resuming checkpoints for single-process, DDP, FSDP2 and HSDP runs: what a save writes when, and when
a checkpoint becomes ``last``.

Saves are collective: every rank enters :meth:`CheckpointManager.save`. DCP shards are written by every rank;
gathered weights, json sidecars and the RNG file by the main process alone. Which weight and optimizer files a
checkpoint holds is :mod:`~lerobot_mg.checkpoint.formats`' concern, training_step.json (the completion marker,
written last) :mod:`~lerobot_mg.checkpoint.resume`'s, a disk that refuses the save :mod:`~lerobot_mg.checkpoint.disk`'s.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.disk import DiskGuard, tree_bytes
from lerobot_mg.checkpoint.ema_files import EMAFiles
from lerobot_mg.checkpoint.formats import AdapterFiles, CheckpointFiles, tensor_bytes
from lerobot_mg.checkpoint.resume import write_training_step
from lerobot_mg.checkpoint.state import (
    gather_rng_states,
    pack_rank_states,
    read_json,
    restore_rank_rng,
    scheduler_state_from_json,
    scheduler_state_to_json,
    unpack_rank_states,
    write_json,
)
from lerobot_mg.config.choices import BestMetric, CheckpointFormat
from lerobot_mg.data.cache import fsync
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.ema import ModelEMA
from lerobot_mg.processors.mixture import save_source_processors

logger = logging.getLogger(__name__)
# torch 2.11's DefaultStager empties its copy table after each stage, so its second stage fails (KeyError: <class
# 'type'>, on a dtype or an enum in the state); before the lock's torch 2.13 every state is staged by a new stager.
_ONE_STAGE_PER_STAGER = torch.__version__ < (2, 13)


@dataclass(frozen=True)
class SaveItems:
    """What a checkpoint holds besides model, optimizer and training_step.json: the same at every save of a run."""

    policy: nn.Module  # the unwrapped policy: writes config.json and gathered weights
    preprocessor: Any
    postprocessor: Any
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: torch.amp.GradScaler | None
    train_config: dict[str, Any]
    # dataset.stats=per_source: each source's (preprocessor, postprocessor) by source name, written beside the
    # default pair (lerobot_mg.processors.mixture.save_source_processors)
    source_processors: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def _barrier(dims: ParallelDims) -> None:
    if dims.is_distributed:
        dist.barrier()


# Managers with a background writer, so that a run that fails can release them (release_background_writers).
_WITH_WRITER: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def release_background_writers() -> None:
    """For a run that raised (a point of a local sweep, before the next one starts): let each background save in
    flight finish and complete it (a consistent state it staged before the failure stays a checkpoint), then stop
    the writer threads. Errors are logged, not raised: the run already failed with its own."""
    for manager in list(_WITH_WRITER):
        try:
            manager.close()
        except Exception as error:  # the save's own failure (a full disk, a lost peer): the run failed anyway
            logger.warning("The background checkpoint save in flight failed while the run stopped: %r", error)


@dataclass
class _InFlight:
    """A save whose files are still being written (by the background writer, or by this thread)."""

    step: int
    tmp: Path
    training_step: dict[str, Any]  # training_step.json, written once every other file is on disk
    started: float  # time.perf_counter() when save() was entered
    blocked_s: float  # how long save() held the training loop
    staged_bytes: int  # host memory the staged copy holds until the write finished (0 when synchronous)
    future: Future[None] | None  # None: written synchronously
    evaluation: dict[str, Any] | None = None  # the step's evaluation (eval_metrics.json), with keep_best


class CheckpointManager:
    """``adapter`` (PEFT runs): weights are the trainable parameters only, as adapter_model.safetensors +
    adapter_config.json or as DCP shards under the same keys; the frozen base is never written.

    ``async_save``: :meth:`save` stages what it writes (model, optimizer) as a copy in host memory and returns;
    a background thread writes it (DCP shards through a gloo process group of their own, so their collectives
    never interleave with training's) while training continues. The completion rules are the synchronous
    ones: training_step.json is written last and ``last`` moves only once every file is on disk, which the main
    process checks at :meth:`poll` (every step), before the next save (at most one is in flight) and at
    :meth:`wait` (end of training, preemption). Constructing the manager is collective when ``async_save`` is
    set in a distributed run (it creates that group).

    ``keep_best=K`` (with ``best_metric``): a save given its step's evaluation writes it as eval_metrics.json; pruning
    spares the K evaluated checkpoints with the best metric (ties: the later step), and ``best`` names the best one,
    moved atomically like ``last``. A resumed run ranks the checkpoints it finds by their own files.
    """

    def __init__(self, output_dir: Path, checkpoint_format: CheckpointFormat | str, keep_last: int | None,
                 dims: ParallelDims, adapter: AdapterFiles | None = None, async_save: bool = False,
                 group_timeout: timedelta | None = None, ema: ModelEMA | None = None,
                 keep_best: int | None = None, best_metric: BestMetric = BestMetric.success_rate):
        self.root = L.checkpoints_root(output_dir)
        self.keep_last, self.keep_best, self.best_metric = keep_last, keep_best, BestMetric(best_metric)
        self.dims = dims
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer") if async_save else None
        # Staging buffers are reused from one save to the next: one copy of the state, not one per save.
        self._stager = DefaultStager(StagingOptions(False, False, False, False)) if async_save else None
        # The run's timeout, as every other group has (None would be torch's 30-minute gloo default, holding the
        # peers of a dead rank that long).
        self._group = (dist.new_group(backend="gloo", timeout=group_timeout)
                       if async_save and dims.is_distributed else None)
        self._files = CheckpointFiles(CheckpointFormat(checkpoint_format), dims, adapter, self._group)
        self._ema = EMAFiles(self._files, ema) if ema is not None else None  # pretrained_model_ema/
        self._disk = DiskGuard(self.root, dims)
        self._in_flight: _InFlight | None = None
        if self._writer is not None:
            _WITH_WRITER.add(self)
        if dims.is_main_process:
            self._remove_partial_saves()

    def _remove_partial_saves(self) -> None:
        """A save interrupted by a crash or a kill leaves ``.tmp-<step>``: never a checkpoint (resume only follows
        ``last`` and complete step directories), so the next start deletes it and says so. Before that, a re-save
        of a step that stopped between its two renames left the earlier copy as ``.replaced-<step>``: it is put back
        (or deleted, when the new copy did arrive), so no step is ever lost."""
        if not self.root.is_dir():
            return
        for earlier in sorted(self.root.glob(f"{L.REPLACED_PREFIX}*")):
            self._restore_replaced(earlier)
        for leftover in sorted(self.root.glob(f"{L.TMP_PREFIX}*")):
            logger.warning("Removing %s: a checkpoint save that never completed (the run stopped while writing it); "
                           "`last` names the last complete one.", leftover)
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)

    def _restore_replaced(self, earlier: Path) -> None:
        final = self.root / earlier.name.removeprefix(L.REPLACED_PREFIX)
        if final.exists() or final.is_symlink():  # the new copy arrived: the earlier one is what the save replaced
            shutil.rmtree(earlier)
            return
        os.replace(earlier, final)
        fsync(self.root)
        logger.warning("Restored %s: saving that step again stopped before the new copy was in place, so the earlier "
                       "copy is kept.", final)

    # ------------------------------------------------------------------------------------------- save ----
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, items: SaveItems,
             training_step: dict[str, Any], blocking: bool = False, evaluation: Any = None) -> None:
        """Write checkpoint ``step`` (``training_step``: its training_step.json, from
        :func:`~lerobot_mg.checkpoint.resume.training_step`); ``last`` moves to it once complete (at once when
        synchronous or ``blocking``, else once the background write finished). ``evaluation``: the evaluation of
        these weights (a dataclass, e.g. ``EvalMetrics``), which keep_best ranks. Collective: every rank calls it."""
        self.wait()  # at most one save in flight
        started = time.perf_counter()
        dims, main = self.dims, self.dims.is_main_process
        tmp = self.root / f"{L.TMP_PREFIX}{L.step_dir_name(step)}"
        if main:
            for stale in self.root.glob(f"{L.TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / L.PRETRAINED_MODEL_DIR).mkdir(parents=True)
            (tmp / L.TRAINING_STATE_DIR).mkdir(parents=True)
            if self._ema is not None:
                (tmp / L.PRETRAINED_MODEL_EMA_DIR).mkdir()
        _barrier(dims)
        pretrained, training_state = tmp / L.PRETRAINED_MODEL_DIR, tmp / L.TRAINING_STATE_DIR
        large = self._files.large_writes(model, optimizer, items.policy, pretrained, training_state)  # collective
        if self._ema is not None:  # collective
            large += self._ema.large_writes(model, items.policy, tmp / L.PRETRAINED_MODEL_EMA_DIR)
        self._disk.check_free_space(tmp, sum(tensor_bytes(item.state) for item in large))  # collective
        staged_bytes = 0
        if self._stager is not None:  # a copy: training goes on changing the originals while the copy is written
            for item in large:
                if item.copy:
                    if _ONE_STAGE_PER_STAGER:
                        self._stager.close()
                        self._stager = DefaultStager(StagingOptions(False, False, False, False))
                    item.state = self._stager.stage(item.state)
                    staged_bytes += tensor_bytes(item.state)
        writes = [partial(item.write, item.state) for item in large]

        in_flight = _InFlight(step, tmp, training_step, started, 0.0, staged_bytes, None,
                              None if evaluation is None or self.keep_best is None else asdict(evaluation))
        if self._writer is None:
            self._write(writes, tmp)
        else:
            in_flight.future = self._writer.submit(self._write, writes, tmp)
        rng_states = gather_rng_states(self.dims.is_distributed)
        if main:
            with self._disk.errors(tmp):
                save_file(pack_rank_states(rng_states), str(training_state / L.RNG_STATE))
                write_json(pretrained / L.TRAIN_CONFIG_JSON, items.train_config)
                if items.preprocessor is not None:
                    items.preprocessor.save_pretrained(pretrained)
                if items.postprocessor is not None:
                    items.postprocessor.save_pretrained(pretrained)
                for source, pipelines in items.source_processors.items():
                    save_source_processors(pretrained, source, pipelines)
                if items.scheduler is not None:
                    write_json(training_state / L.SCHEDULER_STATE, scheduler_state_to_json(items.scheduler.state_dict()))
                if items.scaler is not None:
                    write_json(training_state / L.SCALER_STATE, items.scaler.state_dict())
                if self._ema is not None:
                    self._ema.write_small(tmp, items.train_config, items.preprocessor, items.postprocessor,
                                          items.source_processors)

        if self._writer is None:
            _barrier(dims)  # every shard is on disk before the marker
        in_flight.blocked_s = time.perf_counter() - started
        self._in_flight = in_flight
        if self._writer is None or blocking:
            self.wait()
            _barrier(dims)

    def _write(self, writes: list[Callable[[], None]], tmp: Path) -> None:
        """Run the large writes (here, or on the background writer)."""
        with self._disk.errors(tmp):
            for write in writes:
                write()
            if self._group is not None:  # every rank's writes are on disk once the main process's future is done
                dist.barrier(group=self._group)

    def poll(self) -> None:
        """Finish a background save whose files are all written (the main process writes its marker and moves
        ``last``). Not collective: call it on every rank each step."""
        if self._in_flight is not None and self._in_flight.future is not None and self._in_flight.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is written, then finish it. Not collective, but every rank calls it
        (each waits for its own writes)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        if in_flight.future is not None:
            try:
                in_flight.future.result()
            except BaseException:
                if self.dims.is_main_process:
                    shutil.rmtree(in_flight.tmp, ignore_errors=True)
                raise
        if self.dims.is_main_process:
            with self._disk.errors(in_flight.tmp):
                self._finish(in_flight)

    def close(self) -> None:
        """Finish the save in flight and stop the background writer."""
        try:
            self.wait()
        finally:
            self.close_writer()

    def close_writer(self) -> None:
        """Stop the background writer (after the save in flight, if any, was written or failed)."""
        _WITH_WRITER.discard(self)
        if self._writer is not None:
            self._writer.shutdown()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _finish(self, in_flight: _InFlight) -> None:
        """Main process: mark the checkpoint complete, move ``last`` to it, prune, and log what it cost."""
        name, tmp = L.step_dir_name(in_flight.step), in_flight.tmp
        training_state = tmp / L.TRAINING_STATE_DIR
        if in_flight.evaluation is not None:
            write_json(training_state / L.EVAL_METRICS, in_flight.evaluation)
        write_training_step(training_state, in_flight.training_step)  # the completion marker, last
        fsync(training_state)
        num_bytes = tree_bytes(tmp)
        final = self.root / name
        replaced = None
        if final.exists():
            # Re-saving a step after resuming from an older checkpoint; `last` may name the old copy. Renames
            # instead of a delete keep the old copy whole until the new one is in place; a crash between the two
            # leaves it under a name the next start puts back (_remove_partial_saves), never under .tmp-.
            replaced = self.root / f"{L.REPLACED_PREFIX}{name}"
            os.replace(final, replaced)
            fsync(self.root)
        try:
            os.replace(tmp, final)
        except BaseException:
            if replaced is not None:  # the earlier copy goes back at once; the new one is left as a partial save
                os.replace(replaced, final)
            raise
        self._point(L.LAST_LINK, name)
        best = self._best()
        if best:
            self._point(L.BEST_LINK, best[0])
        fsync(self.root)
        if replaced is not None:
            shutil.rmtree(replaced)
        self._prune(keep={name, *best})
        seconds = time.perf_counter() - in_flight.started
        how = (f"training blocked {in_flight.blocked_s:.2f} s, {in_flight.staged_bytes / 2**20:.1f} MiB staged in host "
               "memory" if in_flight.future is not None else "synchronous")
        logger.info("Checkpoint %s: %.2f MiB written in %.2f s (%s).", final, num_bytes / 2**20, seconds, how)

    def _point(self, link: str, name: str) -> None:
        """``link`` names step directory ``name``: a new symlink renamed over the old one (atomic). A real
        directory in the link's place is moved aside first (:meth:`_move_aside`)."""
        if (self.root / link).is_dir() and not (self.root / link).is_symlink():
            self._move_aside(self.root / link)
        link_tmp = self.root / f"{L.TMP_PREFIX}{link}"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        link_tmp.symlink_to(name)
        os.replace(link_tmp, self.root / link)

    def _move_aside(self, copied: Path) -> None:
        """``last`` or ``best`` as a real directory (a copy made with ``rsync -L``, an object-store sync, a Hub
        download) is a whole checkpoint: it becomes ``<its step>`` when no checkpoint has that name, else
        ``<link>.copy-<its step>``, which nothing deletes. Never deleted here."""
        marker = copied / L.TRAINING_STATE_DIR / L.TRAINING_STEP
        step = L.step_dir_name(int(read_json(marker)["step"])) if marker.is_file() else None
        destination = self.root / step if step is not None else None
        if destination is None or destination.exists() or destination.is_symlink():
            stem, n = f"{copied.name}{L.COPY_INFIX}{step or 'incomplete'}", 1
            destination = self.root / stem
            while destination.exists() or destination.is_symlink():
                n += 1
                destination = self.root / f"{stem}-{n}"
        os.replace(copied, destination)
        logger.warning("%s was a directory, not a link (copied with its links followed): moved to %s, and `%s` is a "
                       "link again.", copied, destination, copied.name)

    def _best(self) -> list[str]:
        """The names of the ``keep_best`` evaluated checkpoints with the best metric, best first (ties: the later
        step first); empty without keep_best."""
        if self.keep_best is None:
            return []
        ranked = []
        for step_dir in L.complete_step_dirs(self.root.parent):
            metrics = step_dir / L.TRAINING_STATE_DIR / L.EVAL_METRICS
            value = read_json(metrics).get(self.best_metric.value) if metrics.is_file() else None
            if value is not None:
                ranked.append((value if self.best_metric.higher_is_better else -value, int(step_dir.name), step_dir.name))
        return [name for *_, name in sorted(ranked, reverse=True)[:self.keep_best]]

    def _prune(self, keep: set[str]) -> None:
        """Delete all but the ``keep_last`` newest checkpoints and ``keep`` (the new one, the best ones)."""
        if self.keep_last is None:
            return
        steps = L.complete_step_dirs(self.root.parent)
        for old in steps[: max(0, len(steps) - self.keep_last)]:
            if old.name not in keep:
                shutil.rmtree(old)

    # ------------------------------------------------------------------------------------------- load ----
    def load(self, step_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler | None, scaler: torch.amp.GradScaler | None) -> None:
        """Restore model, optimizer, scheduler, scaler and this rank's RNG.

        Collective: every rank calls it. Check the checkpoint first with
        :func:`~lerobot_mg.checkpoint.resume.resume_point` (before any process group).
        """
        pretrained, training_state = step_dir / L.PRETRAINED_MODEL_DIR, step_dir / L.TRAINING_STATE_DIR
        self._files.load(model, optimizer, pretrained, training_state)
        if self._ema is not None:
            self._ema.load(step_dir)
        if scheduler is not None and (training_state / L.SCHEDULER_STATE).is_file():
            scheduler.load_state_dict(scheduler_state_from_json(read_json(training_state / L.SCHEDULER_STATE)))
        if scaler is not None and (training_state / L.SCALER_STATE).is_file():
            scaler.load_state_dict(read_json(training_state / L.SCALER_STATE))

        restore_rank_rng(unpack_rank_states(load_file(str(training_state / L.RNG_STATE))), self.dims.rank,
                         self.dims.world_size)
        _barrier(self.dims)
