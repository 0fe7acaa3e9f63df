"""Saving and resuming checkpoints for single-process, DDP, FSDP2 and HSDP runs.

Saves are collective: every rank enters :meth:`CheckpointManager.save`. DCP shards are written by every rank;
gathered weights, json sidecars and the RNG file by the main process alone. Model and optimizer states go
through ``torch.distributed.checkpoint.state_dict`` keyed by parameter FQN, so a DCP checkpoint reshards to
any topology on load, and a non-sharded checkpoint loads into a sharded run and back.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.dcp_io import InPlaceFileSystemReader
from lerobot_mg.checkpoint.state import (
    capture_rng_state,
    flatten_optimizer_state,
    pack_rank_states,
    read_json,
    restore_rng_state,
    scheduler_state_from_json,
    scheduler_state_to_json,
    unflatten_optimizer_state,
    unpack_rank_states,
    write_json,
)
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.errors import ConfigError
from lerobot_mg.run_facts import Progress

if TYPE_CHECKING:
    from lerobot_mg.peft.lora import AdapterWeights

logger = logging.getLogger(__name__)


@dataclass
class SaveItems:
    """Everything a checkpoint holds besides model and optimizer."""

    policy: nn.Module  # the unwrapped policy: writes config.json and gathered weights
    preprocessor: Any
    postprocessor: Any
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: torch.amp.GradScaler | None
    train_config: dict[str, Any]
    training_step: dict[str, Any]  # step, batch arithmetic, topology, sampler position, revisions...


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer under accelerate's wrapper. Loading into a fresh optimizer makes
    torch.distributed.checkpoint take one zero-lr step to create the state; through the wrapper under fp16
    that step goes to the GradScaler, which refuses a step without a scaled loss."""
    return getattr(optimizer, "optimizer", optimizer)


def _barrier(dims: ParallelDims) -> None:
    if dims.is_distributed:
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) state dict: this rank's local shard for a DTensor."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(_tensor_bytes(value) for value in state)
    return 0


def _tree_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


# A write that fails for one of these reasons is the machine's state, not a bug: the user frees space, fixes the
# permissions or picks another output_dir.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def _disk_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed write when it is one of ``_DISK_ERRNOS`` (DCP wraps each rank's error in a
    CheckpointException; safetensors raises its own type with the OS message)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_ERRNOS:
            return seen
        if isinstance(seen, CheckpointException):
            for failure in seen.failures.values():
                found = _disk_error(getattr(failure, "exc", failure))
                if found is not None:
                    return found
        if isinstance(seen, SafetensorError):
            for number in _DISK_ERRNOS:
                if os.strerror(number) in str(seen):
                    return OSError(number, str(seen))
        seen = seen.__cause__ or seen.__context__
    return None


def _save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))


@dataclass
class _LargeWrite:
    """One of a save's large writes: the tensors and what writes them (given the staged copy when asynchronous)."""

    state: Any
    write: Callable[[Any], None]
    copy: bool = True  # False: tensors made for this save alone (a gathered full state), which need no copy


@dataclass
class _InFlight:
    """A save whose files are still being written (by the background writer, or by this thread)."""

    step: int
    tmp: Path
    training_step: dict[str, Any]
    started: float  # time.perf_counter() when save() was entered
    blocked_s: float  # how long save() held the training loop
    staged_bytes: int  # host memory the staged copy holds until the write finished (0 when synchronous)
    future: Future[None] | None  # None: written synchronously


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
    """

    def __init__(self, output_dir: Path, checkpoint_format: str, keep_last: int | None, dims: ParallelDims,
                 adapter: AdapterWeights | None = None, async_save: bool = False,
                 group_timeout: timedelta | None = None):
        self.root = L.checkpoints_root(output_dir)
        self.format = checkpoint_format
        self.keep_last = keep_last
        self.dims = dims
        self.adapter = adapter
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer") if async_save else None
        # Staging buffers are reused from one save to the next: one copy of the state, not one per save.
        self._stager = DefaultStager(StagingOptions(False, False, False, False)) if async_save else None
        # The run's timeout, as every other group has (None would be torch's 30-minute gloo default, holding the
        # peers of a dead rank that long).
        self._group = (dist.new_group(backend="gloo", timeout=group_timeout)
                       if async_save and dims.is_distributed else None)
        self._in_flight: _InFlight | None = None
        self._needed_bytes = 0  # what the save being written needs on this rank (its tensors' bytes)
        self.saved: list[dict[str, Any]] = []  # one record per finished checkpoint: step, bytes, seconds
        if dims.is_main_process:
            self._remove_partial_saves()

    def _remove_partial_saves(self) -> None:
        """A save interrupted by a crash or a kill leaves ``.tmp-<step>``: never a checkpoint (resume only follows
        ``last`` and complete step directories), so the next start deletes it and says so."""
        for leftover in sorted(self.root.glob(f"{L.TMP_PREFIX}*")) if self.root.is_dir() else []:
            logger.warning("Removing %s: a checkpoint save that never completed (the run stopped while writing it); "
                           "`last` names the last complete one.", leftover)
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)

    def _model_state(self, model: nn.Module, full: bool = False) -> dict[str, Any]:
        """The weights a checkpoint holds (adapter keys for PEFT). ``full`` gathers them onto rank 0, on the CPU:
        collective under FSDP."""
        options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=self.adapter is not None)
        state = get_model_state_dict(model, options=options)
        if self.adapter is None or (full and not self.dims.is_main_process):  # a gather leaves other ranks empty
            return state
        return self.adapter.to_adapter(state)

    def _write_weights(self, policy: nn.Module, pretrained: Path, state: dict[str, Any]) -> None:
        """model.safetensors + config.json, or the adapter's files."""
        if self.adapter is not None:
            self.adapter.write(pretrained, state)
        else:
            policy.save_pretrained(pretrained, state_dict=state)

    def _load_model(self, model: nn.Module, pretrained: Path) -> None:
        """Collective under FSDP: DCP shards reshard to this topology; a single file is distributed."""
        strict = self.adapter is None
        if (pretrained / L.MODEL_DCP_DIR).is_dir():
            state = self._model_state(model)
            dcp.load(state, storage_reader=InPlaceFileSystemReader(pretrained / L.MODEL_DCP_DIR))
            if self.adapter is not None:
                state = self.adapter.to_model(state, pretrained / L.MODEL_DCP_DIR)
            set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
            return
        weights = pretrained / (L.ADAPTER_SAFETENSORS if self.adapter is not None else L.MODEL_SAFETENSORS)
        if not weights.is_file():
            raise ConfigError(f"{weights} is missing: the checkpoint was not saved by a run with this run's peft.* "
                              "settings. Fix: resume with the settings it was saved with")
        state = load_file(str(weights))
        if self.adapter is not None:
            state = self.adapter.to_model(state, weights)
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=self.dims.is_sharded, strict=strict))

    # ------------------------------------------------------------------------------------------- save ----
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, items: SaveItems,
             blocking: bool = False) -> Path:
        """Write checkpoint ``step``; ``last`` moves to it once complete (at once when synchronous or ``blocking``,
        else once the background write finished). Collective: every rank calls it."""
        self.wait()  # at most one save in flight
        started = time.perf_counter()
        dims, main = self.dims, self.dims.is_main_process
        optimizer = _torch_optimizer(optimizer)
        name = L.step_dir_name(step)
        tmp = self.root / f"{L.TMP_PREFIX}{name}"
        if main:
            for stale in self.root.glob(f"{L.TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / L.PRETRAINED_MODEL_DIR).mkdir(parents=True)
            (tmp / L.TRAINING_STATE_DIR).mkdir(parents=True)
        _barrier(dims)
        pretrained, training_state = tmp / L.PRETRAINED_MODEL_DIR, tmp / L.TRAINING_STATE_DIR
        large: list[_LargeWrite] = []
        if dims.is_sharded:
            if self.format in ("dcp", "safetensors_dcp"):
                large.append(_LargeWrite(self._model_state(model),
                                         partial(self._dcp_save, pretrained / L.MODEL_DCP_DIR)))
            if self.format in ("safetensors", "safetensors_dcp"):
                # The gather is collective; the full (fp32 master) weights land on rank 0 only, as new CPU tensors
                # that training never touches: they need no staged copy.
                full = self._model_state(model, full=True)
                if main:
                    large.append(_LargeWrite(full, partial(self._write_weights, items.policy, pretrained), copy=False))
            elif main:
                if self.adapter is not None:  # the converter names the merged file after adapter_config.json
                    self.adapter.write_configs(pretrained)
                else:
                    items.policy.write_config(pretrained)
            large.append(_LargeWrite(get_optimizer_state_dict(model, optimizer),
                                     partial(self._dcp_save, training_state / L.OPTIMIZER_DCP_DIR)))
        else:
            # On every rank: an optimizer that has not stepped yet (say every fp16 update so far overflowed) gets
            # its state created here by a zero-lr step, and DDP replicas must keep identical optimizer states.
            optimizer_state = get_optimizer_state_dict(model, optimizer)
            if main:
                tensors, groups = flatten_optimizer_state(optimizer_state)
                write_json(training_state / L.OPTIMIZER_PARAM_GROUPS, groups)
                large += [_LargeWrite(self._model_state(model), partial(self._write_weights, items.policy, pretrained)),
                          _LargeWrite(tensors, partial(_save_safetensors, training_state / L.OPTIMIZER_STATE))]
        self._check_free_space(tmp, sum(_tensor_bytes(item.state) for item in large))  # collective
        staged_bytes = 0
        if self._stager is not None:  # a copy: training goes on changing the originals while the copy is written
            for item in large:
                if item.copy:
                    item.state = self._stager.stage(item.state)
                    staged_bytes += _tensor_bytes(item.state)
        writes = [partial(item.write, item.state) for item in large]

        in_flight = _InFlight(step, tmp, dict(items.training_step), started, 0.0, staged_bytes, None)
        if self._writer is None:
            self._write(writes, tmp)
        else:
            in_flight.future = self._writer.submit(self._write, writes, tmp)
        rng_states = self._gather_rng_states()
        if main:
            with self._disk_errors(tmp):
                save_file(pack_rank_states(rng_states), str(training_state / L.RNG_STATE))
                write_json(pretrained / L.TRAIN_CONFIG_JSON, items.train_config)
                if items.preprocessor is not None:
                    items.preprocessor.save_pretrained(pretrained)
                if items.postprocessor is not None:
                    items.postprocessor.save_pretrained(pretrained)
                if items.scheduler is not None:
                    write_json(training_state / L.SCHEDULER_STATE, scheduler_state_to_json(items.scheduler.state_dict()))
                if items.scaler is not None:
                    write_json(training_state / L.SCALER_STATE, items.scaler.state_dict())

        if self._writer is None:
            _barrier(dims)  # every shard is on disk before the marker
        in_flight.blocked_s = time.perf_counter() - started
        self._in_flight = in_flight
        if self._writer is None or blocking:
            self.wait()
            _barrier(dims)
        return self.root / name

    def _dcp_save(self, directory: Path, state: dict[str, Any]) -> None:
        """Collective over this rank's DCP group (the side group when asynchronous)."""
        dcp.save(state, checkpoint_id=directory, process_group=self._group)

    def _write(self, writes: list[Callable[[], None]], tmp: Path) -> None:
        """Run the large writes (here, or on the background writer)."""
        with self._disk_errors(tmp):
            for write in writes:
                write()
            if self._group is not None:  # every rank's writes are on disk once the main process's future is done
                dist.barrier(group=self._group)

    @contextmanager
    def _disk_errors(self, tmp: Path) -> Iterator[None]:
        """A full or read-only disk becomes a ConfigError naming the path and the bytes; other errors pass."""
        try:
            yield
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            cause = _disk_error(error)
            if cause is None:
                raise
            if self.dims.is_main_process:  # a partial checkpoint is no use; free what it took
                shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(self._disk_message(tmp, str(cause), self._needed_bytes)) from error

    def _disk_message(self, tmp: Path, problem: str, needed: int) -> str:
        last = self.root / L.LAST_LINK
        previous = f"the previous checkpoint {last.resolve()} is intact" if last.exists() else "no earlier checkpoint"
        return (f"could not write checkpoint {tmp}: {problem}; it needs about {needed:,} bytes on this rank; "
                f"{previous}. Fix: free space (or fix the permissions) under {self.root}, or resume into another "
                "output_dir")

    def _check_free_space(self, tmp: Path, needed: int) -> None:
        """Refuse a save that cannot fit before writing any of it. Collective: every rank calls it (each checks
        its own share; all stop together)."""
        self._needed_bytes = needed
        free = shutil.disk_usage(tmp).free
        short = torch.tensor([needed if needed > free else 0], dtype=torch.int64)
        if self.dims.is_distributed:
            dist.all_reduce(short, op=dist.ReduceOp.MAX)
        if int(short) > 0:
            if self.dims.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(self._disk_message(tmp, f"{free:,} bytes free on its file system", int(short)))

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
            with self._disk_errors(in_flight.tmp):
                self._finish(in_flight)

    def close(self) -> None:
        """Finish the save in flight and stop the background writer."""
        self.wait()
        if self._writer is not None:
            self._writer.shutdown()
        if self._stager is not None:
            self._stager.close()

    def _finish(self, in_flight: _InFlight) -> None:
        """Main process: mark the checkpoint complete, move ``last`` to it, prune, and log what it cost."""
        name, tmp = L.step_dir_name(in_flight.step), in_flight.tmp
        training_state = tmp / L.TRAINING_STATE_DIR
        write_json(training_state / L.TRAINING_STEP, in_flight.training_step)  # the completion marker, last
        _fsync_dir(training_state)
        num_bytes = _tree_bytes(tmp)
        final = self.root / name
        replaced = None
        if final.exists():
            # Re-saving a step after resuming from an older checkpoint; `last` may name the old copy. Renames
            # instead of a delete keep the old copy whole until the new one is in place.
            replaced = self.root / f"{L.TMP_PREFIX}replaced-{name}"
            os.replace(final, replaced)
        os.replace(tmp, final)
        link_tmp = self.root / f"{L.TMP_PREFIX}{L.LAST_LINK}"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        link_tmp.symlink_to(name)
        os.replace(link_tmp, self.root / L.LAST_LINK)
        _fsync_dir(self.root)
        if replaced is not None:
            shutil.rmtree(replaced)
        self._prune(keep=name)
        record = {"step": in_flight.step, "bytes": num_bytes, "seconds": time.perf_counter() - in_flight.started,
                  "blocked_s": in_flight.blocked_s, "staged_bytes": in_flight.staged_bytes}
        self.saved.append(record)
        how = (f"training blocked {record['blocked_s']:.2f} s, {record['staged_bytes'] / 2**20:.1f} MiB staged in host "
               "memory" if in_flight.future is not None else "synchronous")
        logger.info("Checkpoint %s: %.2f MiB written in %.2f s (%s).", final, num_bytes / 2**20, record["seconds"], how)

    def _gather_rng_states(self) -> list[dict[str, torch.Tensor]]:
        mine = capture_rng_state()
        if not self.dims.is_distributed:
            return [mine]
        gathered: list[Any] = [None] * self.dims.world_size
        dist.all_gather_object(gathered, mine)
        return gathered

    def _prune(self, keep: str) -> None:
        if self.keep_last is None:
            return
        steps = L.complete_step_dirs(self.root.parent)
        for old in steps[: max(0, len(steps) - self.keep_last)]:
            if old.name != keep:
                shutil.rmtree(old)

    # ------------------------------------------------------------------------------------------- load ----
    def load(
        self,
        step_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        scaler: torch.amp.GradScaler | None,
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, scaler and this rank's RNG; returns training_step.json.

        Collective: every rank calls it. Call :func:`check_resumable` first (before any process group).
        """
        pretrained, training_state = step_dir / L.PRETRAINED_MODEL_DIR, step_dir / L.TRAINING_STATE_DIR
        sharded = self.dims.is_sharded
        optimizer = _torch_optimizer(optimizer)
        self._load_model(model, pretrained)

        if (training_state / L.OPTIMIZER_DCP_DIR).is_dir():
            osd = get_optimizer_state_dict(model, optimizer)
            dcp.load(osd, storage_reader=InPlaceFileSystemReader(training_state / L.OPTIMIZER_DCP_DIR))
            set_optimizer_state_dict(model, optimizer, osd)
        else:
            osd = unflatten_optimizer_state(
                load_file(str(training_state / L.OPTIMIZER_STATE)), read_json(training_state / L.OPTIMIZER_PARAM_GROUPS)
            )
            set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=sharded))

        if scheduler is not None and (training_state / L.SCHEDULER_STATE).is_file():
            scheduler.load_state_dict(scheduler_state_from_json(read_json(training_state / L.SCHEDULER_STATE)))
        if scaler is not None and (training_state / L.SCALER_STATE).is_file():
            scaler.load_state_dict(read_json(training_state / L.SCALER_STATE))

        per_rank = unpack_rank_states(load_file(str(training_state / L.RNG_STATE)))
        info = read_json(training_state / L.TRAINING_STEP)
        if len(per_rank) == self.dims.world_size:
            restore_rng_state(per_rank[self.dims.rank])
        else:
            # Another world size: ranks cannot inherit streams one to one. Reuse rank r mod saved ranks so
            # runs stay reproducible; the sampler decides data order on its own (seed, epoch) anyway.
            restore_rng_state(per_rank[self.dims.rank % len(per_rank)])
        _barrier(self.dims)
        return info


def _dcp_problems(dcp_dir: Path) -> list[str]:
    """Shard files the DCP metadata references that are missing or shorter than the data it places in them."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(dcp_dir)).read_metadata()
    except FileNotFoundError:
        return [".metadata (missing)"]
    except Exception as error:  # a truncated pickle: EOFError, UnpicklingError, ...
        return [f".metadata (unreadable: {type(error).__name__})"]
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        path = dcp_dir / name
        if not path.is_file():
            problems.append(f"{name} (missing)")
        elif path.stat().st_size < end:
            problems.append(f"{name} (truncated: {path.stat().st_size:,} of {end:,} bytes)")
    return problems


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (a header that does not parse, or data shorter than the header
    says), or None. Reads the header only."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                return f"truncated: {size:,} bytes, shorter than its own header"
            header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        return f"not a safetensors file ({size:,} bytes)"
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        return f"truncated: {size:,} of {8 + header_len + end:,} bytes"
    return None


# training_step.json's keys that a resume reads; "progress" must also hold every Progress field.
TRAINING_STEP_KEYS = ("step", "progress", "sampler", "facts")


def check_resumable(step_dir: Path) -> dict[str, Any]:
    """Raise ``ConfigError`` (naming the file and the remedy) if this code cannot resume ``step_dir``: a missing,
    truncated or incomplete file. Reads headers and sizes only.

    Runs before any process group exists; returns training_step.json.
    """
    pretrained, training_state = step_dir / L.PRETRAINED_MODEL_DIR, step_dir / L.TRAINING_STATE_DIR
    earlier = ("resume from an earlier complete checkpoint (config_path="
               f"{step_dir.parent}/<step>/{L.PRETRAINED_MODEL_DIR}/{L.TRAIN_CONFIG_JSON}) or restore the file from a copy")
    marker = training_state / L.TRAINING_STEP
    if not marker.is_file():
        raise ConfigError(
            f"{marker} is missing: {step_dir} is not a complete checkpoint (a save was interrupted). "
            f"Fix: resume from config_path={step_dir.parent / L.LAST_LINK / L.PRETRAINED_MODEL_DIR / L.TRAIN_CONFIG_JSON}, "
            "which always names the last complete checkpoint"
        )
    try:
        info = read_json(marker)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{marker} is not valid JSON ({error}). Fix: {earlier}") from error
    if "facts" not in info:
        raise ConfigError(f"{marker} holds no run facts: the checkpoint was written by an older lerobot_mg. Fix: "
                          "resume it with that version, or start a new run from its weights")
    missing_keys = [key for key in TRAINING_STEP_KEYS if key not in info]
    missing_keys += [f"progress.{f.name}" for f in fields(Progress)
                     if isinstance(info.get("progress"), dict) and f.name not in info["progress"]]
    if missing_keys:
        raise ConfigError(f"{marker} lacks the key(s) {missing_keys} a resume reads. Fix: {earlier}")
    saved_sharded = info["facts"]["topology"]["dp_shard"] > 1

    def check_file(path: Path) -> None:
        problem = _safetensors_problem(path)
        if problem is not None:
            raise ConfigError(f"{path} is {problem}. Fix: {earlier}")

    model_dcp = pretrained / L.MODEL_DCP_DIR
    if model_dcp.is_dir():
        problems = _dcp_problems(model_dcp)
        if problems:
            remedy = (
                f"delete {model_dcp} to resume from {pretrained / L.MODEL_SAFETENSORS}"
                if (pretrained / L.MODEL_SAFETENSORS).is_file() and _safetensors_problem(pretrained / L.MODEL_SAFETENSORS) is None
                else earlier
            )
            raise ConfigError(f"{model_dcp} has unusable shard file(s) {problems}. Fix: {remedy}")
    else:
        weights = [pretrained / name for name in (L.MODEL_SAFETENSORS, L.ADAPTER_SAFETENSORS)
                   if (pretrained / name).is_file()]
        if not weights:
            raise ConfigError(
                f"{pretrained} holds none of {L.MODEL_SAFETENSORS}, {L.ADAPTER_SAFETENSORS}, {L.MODEL_DCP_DIR}/: no "
                f"weights to resume from. Fix: {earlier}"
            )
        for path in weights:
            check_file(path)

    optim_dcp = training_state / L.OPTIMIZER_DCP_DIR
    if optim_dcp.is_dir():
        problems = _dcp_problems(optim_dcp)
        if problems:
            raise ConfigError(f"{optim_dcp} has unusable shard file(s) {problems}. Fix: {earlier}")
    elif (training_state / L.OPTIMIZER_STATE).is_file():
        if saved_sharded:
            raise ConfigError(
                f"{training_state / L.OPTIMIZER_STATE} is a gathered full optimizer state of a sharded run (the "
                "LeRobot <= 0.6.x FSDP layout), which cannot be resumed: sharded runs keep their optimizer as "
                f"DCP shards in {L.OPTIMIZER_DCP_DIR}/. Fix: start a new run from the weights (run "
                "lerobot-mg-convert-dcp if they are DCP shards) instead of resuming"
            )
        check_file(training_state / L.OPTIMIZER_STATE)
        if not (training_state / L.OPTIMIZER_PARAM_GROUPS).is_file():
            raise ConfigError(f"{training_state / L.OPTIMIZER_PARAM_GROUPS} is missing; the optimizer cannot be "
                              f"restored. Fix: {earlier}")
    else:
        raise ConfigError(f"{training_state} holds no optimizer state ({L.OPTIMIZER_STATE} or "
                          f"{L.OPTIMIZER_DCP_DIR}/). Fix: {earlier}")
    if not (training_state / L.RNG_STATE).is_file():
        raise ConfigError(f"{training_state / L.RNG_STATE} is missing; the RNG state cannot be restored. Fix: {earlier}")
    check_file(training_state / L.RNG_STATE)
    return info
