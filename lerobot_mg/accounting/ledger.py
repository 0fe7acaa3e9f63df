"""The run ledger: what a run actually trained on, one JSON line per event, in the run directory.

Equal loop steps hide different numbers of sample presentations and optimizer updates, and a resumed run
can load cleanly yet see a different sample stream (seeds/comparing-runs.md). The ledger records the
arithmetic behind every logged interval and the conditions of every start and resume, so two runs can be
compared on the quantity that matters instead of on the step counter.

Records (field "kind"):
  start / resume  one per process start: loop step, counters, batch arithmetic, topology, world size,
                  precision, code revision, dataset fingerprint, checkpoint format, resumed-from, lr schedule,
                  model (total / trainable parameters, base model path, PEFT settings, parameter bytes per rank)
  interval        one per logged interval: loop step, sample presentations and optimizer updates so far,
                  effective batch, lr, loss (already reduced across ranks), wall time
  update          one per optimizer update: a digest of the global sample indices it consumed

Each line is flushed and fsynced, so a crash loses at most the line being written. A resumed run appends
to the same file; its records replace those of earlier attempts past the resume step (`read_ledger`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

LEDGER_FILENAME = "ledger.jsonl"
START_KINDS = ("start", "resume")


class ResumeCause(Enum):
    """Why a run resumed (start records of kind "resume")."""

    REQUESTED = "requested"  # resume=true config_path=... on the command line
    PREEMPTION = "preemption"  # the last attempt saved on the preemption/time-limit signal; the job was requeued
    REQUEUE = "requeue"  # SLURM restarted the job (node failure, scontrol requeue) from its last periodic checkpoint
    RELAUNCH = "relaunch"  # the same sweep job directory was launched again
_DIGEST_SIZE_BYTES = 8


@dataclass(frozen=True)
class BatchArithmetic:
    """The guide's batch arithmetic, in one place: the banner, the ledger and the comparison all use it.

    Each of `dp_world_size` data-parallel workers loads a `batch_size` microbatch per loop step;
    `grad_accum_steps` loop steps make one optimizer update.
    """

    batch_size: int
    dp_world_size: int
    grad_accum_steps: int

    def __post_init__(self) -> None:
        for name in ("batch_size", "dp_world_size", "grad_accum_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchArithmetic.{name} must be a positive integer, got {value!r}.")

    @property
    def effective_batch_size(self) -> int:
        return self.batch_size * self.dp_world_size * self.grad_accum_steps

    @property
    def samples_per_loop_step(self) -> int:
        return self.batch_size * self.dp_world_size

    def banner(self) -> str:
        return (
            f"batch_size {self.batch_size} x dp_world_size {self.dp_world_size} x grad_accum "
            f"{self.grad_accum_steps} = effective batch {self.effective_batch_size}"
        )

    def sample_presentations(self, loop_steps: int) -> int:
        """Samples drawn over `loop_steps` loop steps, assuming full microbatches."""
        _check_loop_steps(loop_steps)
        return loop_steps * self.samples_per_loop_step

    def optimizer_updates(self, loop_steps: int) -> int:
        """Optimizer updates completed over `loop_steps` loop steps (a partial accumulation is not one)."""
        _check_loop_steps(loop_steps)
        return loop_steps // self.grad_accum_steps

    def as_dict(self) -> dict[str, int]:
        return {
            "batch_size": self.batch_size,
            "dp_world_size": self.dp_world_size,
            "grad_accum_steps": self.grad_accum_steps,
            "effective_batch_size": self.effective_batch_size,
        }


def _check_loop_steps(loop_steps: int) -> None:
    if loop_steps < 0:
        raise ValueError(f"loop_steps must be >= 0, got {loop_steps}.")


def sample_digest(indices: Sequence[int]) -> str:
    """A short stable hash (blake2b, 8 bytes, hex) of the ordered global sample indices of one update.

    Order matters: the same samples in another order give another digest, because order changes the
    accumulated gradient's rounding and the per-microbatch statistics.
    """
    indices_N = np.asarray(indices)
    if indices_N.ndim != 1 or (indices_N.size and indices_N.dtype.kind not in "iu"):
        raise ValueError(
            f"sample_digest expects a flat sequence of integer sample indices, got an array of shape "
            f"{indices_N.shape} and dtype {indices_N.dtype}."
        )
    # A fixed width and byte order make the digest independent of platform and index dtype.
    payload = indices_N.astype("<i8", copy=False).tobytes()
    return hashlib.blake2b(payload, digest_size=_DIGEST_SIZE_BYTES).hexdigest()


class RunLedger:
    """Only the main process writes; every method is a no-op elsewhere (is_main=False)."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.path = Path(run_dir) / LEDGER_FILENAME
        self._is_main = is_main
        self._file: BinaryIO | None = None
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        is_new = not self.path.exists()
        needs_newline = not is_new and _ends_without_newline(self.path)
        # Held open for the whole run (one open per start, not per line); close() releases it.
        self._file = open(self.path, "ab")
        if needs_newline:
            # A crash mid-write left a partial line; end it so the next record starts on a line of its own.
            self._write_bytes(b"\n")
        if is_new:
            _fsync_directory(self.path.parent)

    def __enter__(self) -> RunLedger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def record_start(
        self,
        *,
        kind: str,
        loop_step: int,
        samples_seen: int,
        optimizer_updates: int,
        arithmetic: BatchArithmetic,
        topology: dict,
        world_size: int,
        precision: str,
        code_revision: dict,
        dataset_fingerprint: str,
        checkpoint_format: str,
        resumed_from: str | None,
        lr_schedule: dict,
        sampler_continuation: str | None,
        model: dict[str, Any] | None = None,
        resume_cause: ResumeCause | None = None,
    ) -> None:
        """Record one start ("start") or resume ("resume"); the counters are those the run starts from. ``model``:
        total and trainable parameters, the base model path and PEFT settings, parameter bytes per rank."""
        if kind not in START_KINDS:
            raise ValueError(f"record_start kind must be one of {START_KINDS}, got {kind!r}.")
        if kind == "resume" and resumed_from is None:
            raise ValueError(
                "record_start(kind='resume') needs resumed_from: the checkpoint it resumed from."
            )
        self._write(
            {
                "kind": kind,
                "time": time.time(),
                "loop_step": loop_step,
                "samples_seen": samples_seen,
                "optimizer_updates": optimizer_updates,
                **arithmetic.as_dict(),
                "topology": topology,
                "world_size": world_size,
                "precision": precision,
                "code_revision": code_revision,
                "dataset_fingerprint": dataset_fingerprint,
                "checkpoint_format": checkpoint_format,
                "resumed_from": resumed_from,
                "lr_schedule": lr_schedule,
                "sampler_continuation": sampler_continuation,
                "model": model,
                "resume_cause": resume_cause.value if resume_cause is not None else None,
            }
        )

    def record_interval(
        self,
        *,
        loop_step: int,
        samples_seen: int,
        optimizer_updates: int,
        effective_batch_size: int,
        lr: float,
        loss: float,
        wall_time_s: float,
        extra: dict | None = None,
    ) -> None:
        """Record one logged interval; counters are totals so far, `wall_time_s` counts from this start."""
        record: dict[str, Any] = {
            "kind": "interval",
            "time": time.time(),
            "loop_step": loop_step,
            "samples_seen": samples_seen,
            "optimizer_updates": optimizer_updates,
            "effective_batch_size": effective_batch_size,
            "lr": float(lr),
            "loss": float(loss),
            "wall_time_s": float(wall_time_s),
        }
        if extra:
            record["extra"] = extra
        self._write(record)

    def record_update(self, *, optimizer_update: int, loop_step: int, digest: str, num_samples: int) -> None:
        """Record the sample digest of optimizer update number `optimizer_update` (1-based)."""
        self._write(
            {
                "kind": "update",
                "time": time.time(),
                "optimizer_update": optimizer_update,
                "loop_step": loop_step,
                "digest": digest,
                "num_samples": num_samples,
            }
        )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        self._write_bytes((json.dumps(record) + "\n").encode("utf-8"))

    def _write_bytes(self, payload: bytes) -> None:
        if not self._is_main:
            return
        assert self._file is not None, f"RunLedger({self.path}) written after close()"
        self._file.write(payload)
        self._file.flush()
        os.fsync(self._file.fileno())


def _ends_without_newline(path: Path) -> bool:
    with open(path, "rb") as file:
        file.seek(0, os.SEEK_END)
        if file.tell() == 0:
            return False
        file.seek(-1, os.SEEK_END)
        return file.read(1) != b"\n"


def _fsync_directory(directory: Path) -> None:
    # The new file's directory entry must reach the disk too, or a crash can lose the whole ledger.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class StartRecord:
    kind: str
    time: float
    loop_step: int
    samples_seen: int
    optimizer_updates: int
    arithmetic: BatchArithmetic
    topology: dict
    world_size: int
    precision: str
    code_revision: dict
    dataset_fingerprint: str
    checkpoint_format: str
    resumed_from: str | None
    lr_schedule: dict
    sampler_continuation: str | None
    resume_cause: ResumeCause | None = None

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StartRecord:
        return cls(
            kind=record["kind"],
            time=float(record["time"]),
            loop_step=int(record["loop_step"]),
            samples_seen=int(record["samples_seen"]),
            optimizer_updates=int(record["optimizer_updates"]),
            arithmetic=BatchArithmetic(
                batch_size=int(record["batch_size"]),
                dp_world_size=int(record["dp_world_size"]),
                grad_accum_steps=int(record["grad_accum_steps"]),
            ),
            topology=dict(record["topology"]),
            world_size=int(record["world_size"]),
            precision=str(record["precision"]),
            code_revision=dict(record["code_revision"]),
            dataset_fingerprint=str(record["dataset_fingerprint"]),
            checkpoint_format=str(record["checkpoint_format"]),
            resumed_from=record["resumed_from"],
            lr_schedule=dict(record["lr_schedule"]),
            sampler_continuation=record["sampler_continuation"],
            resume_cause=ResumeCause(record["resume_cause"]) if record.get("resume_cause") else None,
        )


@dataclass(frozen=True)
class IntervalRecord:
    time: float
    loop_step: int
    samples_seen: int
    optimizer_updates: int
    effective_batch_size: int
    lr: float
    loss: float
    wall_time_s: float
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> IntervalRecord:
        return cls(
            time=float(record["time"]),
            loop_step=int(record["loop_step"]),
            samples_seen=int(record["samples_seen"]),
            optimizer_updates=int(record["optimizer_updates"]),
            effective_batch_size=int(record["effective_batch_size"]),
            lr=float(record["lr"]),
            loss=float(record["loss"]),
            wall_time_s=float(record["wall_time_s"]),
            extra=dict(record.get("extra", {})),
        )


@dataclass(frozen=True)
class UpdateRecord:
    time: float
    optimizer_update: int
    loop_step: int
    digest: str
    num_samples: int

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> UpdateRecord:
        return cls(
            time=float(record["time"]),
            optimizer_update=int(record["optimizer_update"]),
            loop_step=int(record["loop_step"]),
            digest=str(record["digest"]),
            num_samples=int(record["num_samples"]),
        )


@dataclass(frozen=True)
class Segment:
    """One process start (fresh or resumed) and the records it wrote before the next start."""

    start: StartRecord
    intervals: tuple[IntervalRecord, ...]
    updates: tuple[UpdateRecord, ...]


@dataclass(frozen=True)
class RunRecord:
    """A parsed ledger. `segments` holds every attempt as written; the properties give the effective run."""

    run_dir: Path
    segments: tuple[Segment, ...]
    num_skipped_lines: int

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def effective_segments(self) -> tuple[Segment, ...]:
        """Each segment cut at the step a later attempt resumed from; attempts wholly redone are dropped.

        A run that crashed at step 70 and resumed from the step-50 checkpoint re-logs steps 51-70: the
        first attempt keeps steps <= 50, the second attempt supplies the rest.
        """
        kept: list[Segment] = []
        cutoff = math.inf
        for segment in reversed(self.segments):
            if segment.start.loop_step < cutoff:
                kept.append(
                    Segment(
                        start=segment.start,
                        intervals=tuple(r for r in segment.intervals if r.loop_step <= cutoff),
                        updates=tuple(r for r in segment.updates if r.loop_step <= cutoff),
                    )
                )
            cutoff = min(cutoff, segment.start.loop_step)
        return tuple(reversed(kept))

    def superseded(self, segment: Segment) -> bool:
        """True when a later attempt resumed from a step at or before this segment's start."""
        return all(segment.start is not kept.start for kept in self.effective_segments)

    @property
    def intervals(self) -> tuple[IntervalRecord, ...]:
        return tuple(r for segment in self.effective_segments for r in segment.intervals)

    @property
    def updates(self) -> tuple[UpdateRecord, ...]:
        return tuple(r for segment in self.effective_segments for r in segment.updates)

    @property
    def first_start(self) -> StartRecord:
        return self.segments[0].start

    @property
    def last_start(self) -> StartRecord:
        return self.segments[-1].start

    @property
    def final_interval(self) -> IntervalRecord | None:
        intervals = self.intervals
        return intervals[-1] if intervals else None

    @property
    def total_wall_time_s(self) -> float:
        """Training wall time of the effective run: each kept attempt up to its last kept interval."""
        return sum(s.intervals[-1].wall_time_s for s in self.effective_segments if s.intervals)

    def segment_at(self, loop_step: int) -> Segment:
        """The effective segment that trained loop step `loop_step` (the last one starting before it)."""
        effective = self.effective_segments
        for segment in reversed(effective):
            if segment.start.loop_step < loop_step:
                return segment
        return effective[0]


def read_ledger(run_dir: Path) -> RunRecord:
    """Parse `run_dir/ledger.jsonl`.

    A line that is not valid JSON is tolerated (and counted) only where a crash can leave one: as the last
    line, or right before a start/resume record. Anywhere else the ledger is corrupt and this raises.
    """
    run_dir = Path(run_dir)
    path = run_dir / LEDGER_FILENAME
    if not path.is_file():
        raise ValueError(
            f"{run_dir} has no {LEDGER_FILENAME}: pass a run directory written by lerobot_mg training "
            "(the directory that holds checkpoints/ and train_config.json)."
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    parsed: list[tuple[int, dict[str, Any] | None]] = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            parsed.append((line_number, None))
            continue
        if not isinstance(record, dict) or "kind" not in record:
            raise ValueError(
                f"{path}:{line_number}: expected a JSON object with a 'kind' field, got {line!r}."
            )
        parsed.append((line_number, record))

    segments: list[Segment] = []
    num_skipped_lines = 0
    current: tuple[StartRecord, list[IntervalRecord], list[UpdateRecord]] | None = None
    for position, (line_number, record) in enumerate(parsed):
        if record is None:
            following = parsed[position + 1][1] if position + 1 < len(parsed) else None
            if position + 1 == len(parsed) or (following is not None and following["kind"] in START_KINDS):
                num_skipped_lines += 1
                continue
            raise ValueError(
                f"{path}:{line_number}: unreadable line in the middle of a run segment; only a crash's last "
                "line may be partial. The ledger is corrupt: restore it or compare a different run."
            )
        kind = record["kind"]
        try:
            if kind in START_KINDS:
                if current is not None:
                    segments.append(Segment(current[0], tuple(current[1]), tuple(current[2])))
                current = (StartRecord.from_json(record), [], [])
            elif current is None:
                raise ValueError(f"{path}:{line_number}: a {kind!r} record before any start record.")
            elif kind == "interval":
                current[1].append(IntervalRecord.from_json(record))
            elif kind == "update":
                current[2].append(UpdateRecord.from_json(record))
            else:
                raise ValueError(
                    f"{path}:{line_number}: unknown record kind {kind!r}; expected one of "
                    f"{(*START_KINDS, 'interval', 'update')}."
                )
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path}:{line_number}: malformed {kind!r} record ({error!r}).") from error
    if current is None:
        raise ValueError(f"{path} holds no start record: the run never started training.")
    segments.append(Segment(current[0], tuple(current[1]), tuple(current[2])))
    return RunRecord(run_dir=run_dir, segments=tuple(segments), num_skipped_lines=num_skipped_lines)
