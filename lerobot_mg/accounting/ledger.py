"""The run ledger, the run's one time series: ``<run>/ledger.jsonl``, one ``{"kind": ..., **asdict(record)}`` line
per process start (``StartRecord``), per logged interval (``IntervalRecord``: every ``log_freq`` loop steps, each
checkpoint and the last step), per evaluation (``EvalRecord``: every ``eval.freq`` loop steps and the last step)
and per stop on a signal (``StopRecord``: Ctrl-C, SIGTERM, preemption). Lines are flushed as written and fsynced at checkpoints and at close: a crash loses at
most the lines since the last checkpoint, which the resume from it writes again. A resumed run appends; its records
replace earlier attempts' past its resume step.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lerobot_mg.data.cache import fsync
from lerobot_mg.errors import ConfigError
from lerobot_mg.run_facts import Progress, RunFacts, from_dict

LEDGER_FILENAME = "ledger.jsonl"


@dataclass(frozen=True)
class UpdateDigest:
    """What one optimizer update trained on: a digest of the ``index`` values its global batch delivered, with
    their positions (lerobot_mg.tracking.LoaderDigests), and how many there were."""

    optimizer_update: int
    loop_step: int
    digest: str
    num_samples: int


@dataclass(frozen=True)
class StartRecord:
    time: float
    progress: Progress  # the counters this start continues from
    facts: RunFacts

    @property
    def kind(self) -> str:
        return "start" if self.facts.resumed_from is None else "resume"


@dataclass(frozen=True)
class IntervalRecord:
    time: float
    progress: Progress
    wall_time_s: float  # since this process started
    # loss, lr and the rest, reduced across ranks; the throughput figures (samples_per_s, mfu, dataloading_s and
    # the other phases, the slowest rank's and rank 0's, peak_device_memory_gb): lerobot_mg.accounting.throughput
    metrics: dict[str, float]
    updates: tuple[UpdateDigest, ...] = ()
    # A dataset mixture: per source name, what the interval's global batches drew from it: {"samples": int,
    # "episodes": int (distinct episodes of that source)}. Empty for a single dataset.
    sources: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalMetrics:
    """One evaluation, reduced over every rank: the rollouts in simulation (None where eval.n_episodes=0) and the
    loss on the held-out episodes (None without dataset.val_episodes)."""

    n_episodes: int = 0
    num_successes: int | None = None
    success_rate: float | None = None
    mean_return: float | None = None
    mean_episode_length: float | None = None  # simulation steps; a success ends its episode early
    val_loss: float | None = None  # sum of the batches' losses x samples, over the samples
    val_samples: int = 0

    def value(self, metric: str) -> float | None:
        """``success_rate`` or ``val_loss`` (checkpoint.best_metric)."""
        return getattr(self, metric)

    def tracker_metrics(self) -> dict[str, float]:
        """What wandb and trackio get, under ``eval/``: every figure this evaluation has."""
        return {f"eval/{key}": float(value) for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class EvalRecord:
    time: float
    progress: Progress  # the counters of the evaluated weights: loop step, samples seen, optimizer updates
    seconds: float  # the evaluation's wall time (the slowest rank's)
    metrics: EvalMetrics

    kind = "eval"


@dataclass(frozen=True)
class StopRecord:
    """The run stopped on a signal, after the checkpoint of ``progress.step`` (lerobot_mg.launch.preemption)."""

    time: float
    progress: Progress
    signal: str  # SIGINT, SIGTERM, or submitit's preemption signal
    checkpoint: str | None  # the checkpoint written at the stop (None: checkpoint.save_checkpoint=false)
    requeued: bool = False  # a preempted SLURM job handed back to the queue

    kind = "stop"


class RunLedger:
    """Appends records; only the main process writes (every method is a no-op elsewhere)."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.path = Path(run_dir) / LEDGER_FILENAME
        self._file = None
        if is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a+b")  # held open until close()
            end = self._file.tell()
            if end and os.pread(self._file.fileno(), 1, end - 1) != b"\n":
                self._file.write(b"\n")  # a crash left a torn line: the next record starts a line of its own
            self.sync()  # a new file's directory entry, too

    def write(self, record: StartRecord | IntervalRecord | EvalRecord | StopRecord) -> None:
        if self._file is not None:
            kind = "interval" if isinstance(record, IntervalRecord) else record.kind
            self._file.write(json.dumps({"kind": kind, **asdict(record)}).encode() + b"\n")
            self._file.flush()

    def sync(self) -> None:
        """Make every line so far durable: at checkpoints and at close, never per line (it is slow)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            fsync(self.path.parent)

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None


@dataclass(frozen=True)
class Segment:
    """One process start (fresh or resumed) and the intervals it logged before the next start."""

    start: StartRecord
    intervals: tuple[IntervalRecord, ...]
    stop: StopRecord | None = None  # the segment ended on a signal
    evals: tuple[EvalRecord, ...] = ()


@dataclass(frozen=True)
class RunRecord:
    """A parsed ledger. ``segments`` holds every attempt as written; the properties give the effective run."""

    run_dir: Path
    segments: tuple[Segment, ...]

    @property
    def effective_segments(self) -> tuple[Segment, ...]:
        """Each segment cut at the step a later attempt resumed from; attempts wholly redone are dropped.

        A run that crashed at step 70 and resumed from the step-50 checkpoint logs steps 51-70 again: the first
        attempt keeps steps <= 50, the second supplies the rest. Every checkpoint ends an interval, so a cut
        never splits one.
        """
        kept: list[Segment] = []
        cutoff = math.inf
        for segment in reversed(self.segments):
            if segment.start.progress.step < cutoff:
                kept.append(Segment(segment.start, tuple(r for r in segment.intervals if r.progress.step <= cutoff),
                                    segment.stop, tuple(r for r in segment.evals if r.progress.step <= cutoff)))
            cutoff = min(cutoff, segment.start.progress.step)
        return tuple(reversed(kept))

    def superseded(self, segment: Segment) -> bool:
        """True when a later attempt resumed from a step at or before this segment's start."""
        return all(segment.start is not kept.start for kept in self.effective_segments)

    @property
    def intervals(self) -> tuple[IntervalRecord, ...]:
        return tuple(r for segment in self.effective_segments for r in segment.intervals)

    @property
    def evals(self) -> tuple[EvalRecord, ...]:
        return tuple(r for segment in self.effective_segments for r in segment.evals)

    @property
    def updates(self) -> tuple[UpdateDigest, ...]:
        return tuple(update for interval in self.intervals for update in interval.updates)

    @property
    def final_interval(self) -> IntervalRecord | None:
        return self.intervals[-1] if self.intervals else None

    @property
    def total_wall_time_s(self) -> float:
        """Training wall time of the effective run: each kept attempt up to its last kept interval."""
        return sum(s.intervals[-1].wall_time_s for s in self.effective_segments if s.intervals)


def read_ledger(run_dir: Path) -> RunRecord:
    """Parse ``run_dir/ledger.jsonl``. A line that is not JSON is skipped only where a crash can leave one: last,
    or right before a start/resume record. Anywhere else the ledger is corrupt and this raises."""
    path = Path(run_dir) / LEDGER_FILENAME
    if not path.is_file():
        raise ConfigError(f"{run_dir}: has no {LEDGER_FILENAME}, it is not a run directory of lerobot_mg training. "
                         "Fix: pass the directory that holds checkpoints/ and train_config.json")
    lines = [(number, _parse(line)) for number, line in enumerate(path.read_text("utf-8").splitlines(), 1)
             if line.strip()]
    attempts: list[tuple[StartRecord, list[IntervalRecord], list[StopRecord], list[EvalRecord]]] = []
    for position, (number, record) in enumerate(lines):
        kind = record.pop("kind", None) if record is not None else None
        try:
            if kind in ("start", "resume"):
                attempts.append((from_dict(StartRecord, record), [], [], []))
            elif kind == "interval" and attempts:
                attempts[-1][1].append(from_dict(IntervalRecord, record))
            elif kind == "stop" and attempts:
                attempts[-1][2].append(from_dict(StopRecord, record))
            elif kind == "eval" and attempts:
                attempts[-1][3].append(from_dict(EvalRecord, record))
            elif record is not None:
                raise ConfigError(f"{path}:{number}: expected a start, resume, interval, eval or stop record after a start "
                                 f"record, got kind {kind!r}. Fix: restore the ledger, or compare another run")
            elif position + 1 < len(lines) and (lines[position + 1][1] or {}).get("kind") not in ("start", "resume"):
                raise ConfigError(f"{path}:{number}: unreadable line in the middle of a run segment; only a crash's "
                                 "last line may be partial, so the ledger is corrupt. Fix: restore it, or compare another run")
        except (KeyError, TypeError) as error:
            raise ConfigError(f"{path}:{number}: malformed {kind!r} record ({error!r}). Fix: restore the ledger, or "
                              "compare another run") from error
    if not attempts:
        raise ConfigError(f"{path}: holds no start record, the run never started training. Fix: compare a run "
                          "that trained")
    return RunRecord(Path(run_dir), tuple(Segment(start, tuple(intervals), stops[-1] if stops else None, tuple(evals))
                                          for start, intervals, stops, evals in attempts))


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None  # torn: read_ledger decides whether it may be skipped
    return record if isinstance(record, dict) else {"kind": None}
