"""Honest comparison of runs from their ledgers (docs/comparing-runs.md): equal loop steps can hide half the data
exposure and a clean resume can change the sample stream, so a comparison states each run's arithmetic behind the
step counter, which quantities the runs held fixed, the conditions of every start and resume, and (on request)
whether a resumed run's loaders delivered the reference run's samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lerobot_mg.accounting.ledger import RunRecord, StartRecord, UpdateDigest
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Continuation
from lerobot_mg.errors import ConfigError
from lerobot_mg.run_facts import FactChange, Progress, describe

HELD_FIXED_QUANTITIES = ("data exposure", "update count", "effective batch", "compute budget")
COMPUTE_BUDGET_TOLERANCE = 0.10  # wall time is never reproduced exactly: within 10 % two budgets are the same
STREAM_FACTS = ("batch", "topology", "dataset_fingerprint")  # changed at a resume, they change the sample stream


@dataclass(frozen=True)
class RunSummary:
    """One run's arithmetic. Tuples hold each distinct value in order (more than one: changed at a resume)."""

    label: str
    run_dir: Path
    arithmetic: tuple[BatchArithmetic, ...]
    world_sizes: tuple[int, ...]
    lr_schedules: tuple[dict, ...]
    precisions: tuple[str, ...]
    total: Progress
    shared: Progress  # at the loop step every run reached
    shared_exact: bool  # False: derived from the batch arithmetic, no interval ended at that step
    final_lr: float | None
    final_loss: float | None
    wall_time_s: float
    compute_budget_worker_s: float


@dataclass(frozen=True)
class StartConditions:
    """One start or resume of a run, and what changed against the attempt before it."""

    start: StartRecord
    superseded: bool  # a later attempt resumed from a step at or before this one
    rerun_to: int | None  # the step the previous attempt had reached past this resume step
    changes: tuple[FactChange, ...]

    def flags(self) -> list[str]:
        at, revision = f"at {self.start.kind} (step {self.start.progress.step})", self.start.facts.code_revision
        flags = [f"code revision unknown {at}: not run from a git checkout"] if revision.commit is None else []
        if revision.commit is not None and revision.dirty:
            flags.append(f"uncommitted changes {at}: commit {revision.describe()} does not pin the code that ran")
        if self.rerun_to is not None:
            flags.append(f"steps {self.start.progress.step + 1}-{self.rerun_to} re-run {at}: the previous attempt "
                         f"reached step {self.rerun_to}; its records past the resume step are superseded")
        return flags + [change.describe(at) for change in self.changes]


@dataclass(frozen=True)
class Comparison:
    runs: tuple[RunSummary, ...]
    shared_loop_step: int
    table: tuple[tuple[str, tuple[str, ...]], ...]  # (quantity, one cell per run)
    held_fixed: dict[str, bool]
    same_lr_schedule: bool
    same_accumulation: bool
    differences: tuple[str, ...]
    conditions: dict[str, tuple[StartConditions, ...]]
    cross_run_flags: tuple[str, ...]


def run_labels(records: Sequence[RunRecord]) -> list[str]:
    """Short unique names: the run directory's name, with its parent's when two names collide."""
    names = [record.run_dir.name for record in records]
    labels = [f"{r.run_dir.parent.name}/{name}" if names.count(name) > 1 else name for r, name in zip(records, names)]
    return labels if len(set(labels)) == len(labels) else [str(record.run_dir) for record in records]


def distinct(values: Sequence[Any]) -> tuple[Any, ...]:
    """Values in order, consecutive repeats dropped (what a run went through)."""
    return tuple(value for i, value in enumerate(values) if i == 0 or values[i - 1] != value)


def joined(values: Sequence[Any]) -> str:
    return " -> ".join(f"{value:,}" if isinstance(value, int) else describe(value) for value in values)


def counts_at(record: RunRecord, loop_step: int) -> tuple[Progress, bool]:
    """The counters at ``loop_step`` and whether they are exact: as recorded where an interval ended there, else derived
    from the last record before it with the batch arithmetic in force (full micro-batches; updates on multiples of
    the accumulation)."""
    effective = record.effective_segments  # the segment that trained loop_step: the last one starting before it
    segment = next((s for s in reversed(effective) if s.start.progress.step < loop_step), effective[0])
    base = next((r.progress for r in reversed(segment.intervals) if r.progress.step <= loop_step),
                segment.start.progress)
    batch = segment.start.facts.batch
    updates = base.optimizer_updates + loop_step // batch.grad_accum_steps - base.step // batch.grad_accum_steps
    samples = base.samples_seen + batch.sample_presentations(loop_step - base.step)
    return Progress(loop_step, samples, updates, base.skipped_updates), base.step == loop_step


def _total(record: RunRecord) -> Progress:
    final = record.final_interval
    return final.progress if final is not None else record.effective_segments[-1].start.progress


def summarize_run(record: RunRecord, label: str, shared_loop_step: int) -> RunSummary:
    effective, final = record.effective_segments, record.final_interval
    facts = [segment.start.facts for segment in effective]
    return RunSummary(
        label, record.run_dir, distinct([f.batch for f in facts]), distinct([f.topology.world_size for f in facts]),
        distinct([f.lr_schedule for f in facts]), distinct([f.precision for f in facts]), _total(record),
        *counts_at(record, shared_loop_step), None if final is None else final.metrics["lr"],
        None if final is None else final.metrics["loss"], record.total_wall_time_s,
        sum(s.intervals[-1].wall_time_s * s.start.facts.topology.world_size for s in effective if s.intervals),
    )


def start_conditions(record: RunRecord) -> tuple[StartConditions, ...]:
    """Every start and resume of a run, with what changed against the attempt before it."""
    conditions = []
    for previous, segment in zip((None, *record.segments), record.segments):
        rerun_to, changes = None, ()
        if previous is not None:
            reached = max([previous.start.progress.step, *(r.progress.step for r in previous.intervals)])
            rerun_to = reached if reached > segment.start.progress.step else None
            changes = segment.start.facts.changes_since(previous.start.facts)
        conditions.append(StartConditions(segment.start, record.superseded(segment), rerun_to, changes))
    return tuple(conditions)


def _same(values: Sequence[Any]) -> bool:
    return all(value == values[0] for value in values[1:])


def compare_runs(records: Sequence[RunRecord]) -> Comparison:
    """Compare runs on their arithmetic; ``records`` come from ``read_ledger``, at least two."""
    if len(records) < 2:
        raise ConfigError(f"comparing runs needs at least two run directories, got {len(records)}.")
    labels = run_labels(records)
    step = min(_total(record).step for record in records)
    runs = tuple(summarize_run(r, label, step) for r, label in zip(records, labels))

    def arithmetic(name: str) -> tuple[str, ...]:
        return tuple(joined(distinct([getattr(a, name) for a in run.arithmetic])) for run in runs)

    def counts(name: str, which: str) -> tuple[str, ...]:
        return tuple(("~{:,}" if which == "shared" and not r.shared_exact else "{:,}").format(
            getattr(getattr(r, which), name)) for r in runs)

    # (quantity, cells, whether the runs differing in it is named); "~" marks a count derived from the arithmetic.
    rows = [("microbatch per worker", arithmetic("batch_size"), True),
            ("data-parallel workers", arithmetic("dp_world_size"), True),
            ("accumulation steps", arithmetic("grad_accum_steps"), True),
            ("effective batch", arithmetic("effective_batch_size"), True),
            ("world size", tuple(joined(r.world_sizes) for r in runs), False),
            ("precision", tuple(joined(r.precisions) for r in runs), True),
            (f"sample presentations @ loop step {step:,}", counts("samples_seen", "shared"), True),
            (f"optimizer updates @ loop step {step:,}", counts("optimizer_updates", "shared"), True),
            ("loop steps (total)", counts("step", "total"), True),
            ("sample presentations (total)", counts("samples_seen", "total"), True),
            ("optimizer updates (total)", counts("optimizer_updates", "total"), True),
            ("lr schedule", tuple(joined(r.lr_schedules) for r in runs), True),
            ("final lr", tuple("-" if r.final_lr is None else f"{r.final_lr:.4g}" for r in runs), False),
            ("final loss", tuple("-" if r.final_loss is None else f"{r.final_loss:.4g}" for r in runs), False),
            ("wall time (s)", tuple(f"{r.wall_time_s:.1f}" for r in runs), False),
            ("compute budget (worker-s)", tuple(f"{r.compute_budget_worker_s:.1f}" for r in runs), False)]

    def listing(values: Sequence[Any]) -> str:
        return ", ".join(f"{label} {value}" for label, value in zip(labels, values))

    differences = [f"{name} differs: {listing(cells)}" for name, cells, named in rows if named and not _same(cells)]
    budgets = [run.compute_budget_worker_s for run in runs]
    same_budget = min(budgets) > 0 and max(budgets) <= min(budgets) * (1 + COMPUTE_BUDGET_TOLERANCE)
    if min(budgets) <= 0:
        differences.append("compute budget unknown: a run logged no interval with wall time")
    elif not same_budget:
        differences.append(f"compute budget (worker-seconds) differs by more than {COMPUTE_BUDGET_TOLERANCE:.0%}: "
                           f"{listing([f'{b:.1f}' for b in budgets])}")
    effective_batches = [distinct([a.effective_batch_size for a in run.arithmetic]) for run in runs]
    first = [record.segments[0].start.facts for record in records]
    cross_run = [("code revision", [f.code_revision.describe() for f in first]),
                 ("dataset", [f.dataset_fingerprint for f in first]),
                 ("checkpoint format", [f.checkpoint_format for f in first])]
    return Comparison(
        runs=runs, shared_loop_step=step, table=tuple((name, cells) for name, cells, _ in rows),
        held_fixed={"data exposure": _same([r.total.samples_seen for r in runs]),
                    "update count": _same([r.total.optimizer_updates for r in runs]),
                    "effective batch": all(len(b) == 1 for b in effective_batches) and _same(effective_batches),
                    "compute budget": same_budget},
        same_lr_schedule=all(len(r.lr_schedules) == 1 for r in runs) and _same([r.lr_schedules for r in runs]),
        same_accumulation=_same([distinct([a.grad_accum_steps for a in r.arithmetic]) for r in runs]),
        differences=tuple(differences),
        conditions={label: start_conditions(record) for record, label in zip(records, labels)},
        cross_run_flags=tuple(f"{name} differs between runs: {listing(values)}"
                              for name, values in cross_run if not _same(values)),
    )


# ----------------------------------------------------------------------------------------------------------
# What the loaders delivered around a resume


@dataclass(frozen=True)
class BoundaryCheck:
    loop_step: int
    optimizer_update: int
    num_compared_before: int
    num_compared_after: int
    first_divergence: tuple[UpdateDigest, UpdateDigest] | None  # (resumed, reference)
    verdict: Continuation | None  # None: no digests after the boundary, nothing verified
    message: str


@dataclass(frozen=True)
class ResumeCheck:
    resumed: str
    reference: str
    boundaries: tuple[BoundaryCheck, ...]
    verdict: Continuation | None

    @property
    def passed(self) -> bool:
        """Every optimizer update after each resume trained on the reference's samples, in the reference's order."""
        return self.verdict in (Continuation.SAMPLE_EXACT, Continuation.GLOBAL_BATCH_EXACT)


def pick_resumed_run(records: Sequence[RunRecord]) -> tuple[RunRecord, RunRecord]:
    """(resumed, reference) for ``check_resume``: the first run with a resume is the resumed one."""
    if len(records) != 2:
        raise ConfigError(f"check_resume compares exactly two runs (a resumed run and a reference), got {len(records)}.")
    for position, record in enumerate(records):
        if any(segment.start.kind == "resume" for segment in record.effective_segments):
            return record, records[1 - position]
    raise ConfigError(f"check_resume needs a resumed run, but neither {records[0].run_dir} nor {records[1].run_dir} "
                     "has a resume record in its ledger.")


def check_resume(resumed: RunRecord, reference: RunRecord, window: int | None = None) -> ResumeCheck:
    """Compare the digests of what the loaders of ``resumed`` and ``reference`` delivered, update by update, around
    each resume. ``window`` limits it to that many updates on either side of a resume; None compares all."""
    if window is not None and window < 1:
        raise ConfigError(f"window={window}: must be a positive number of optimizer updates. Fix: window=2")
    theirs = {update.optimizer_update: update for update in reference.updates}
    boundaries = []
    for conditions in start_conditions(resumed):
        start, boundary = conditions.start, conditions.start.progress.optimizer_updates
        if start.kind != "resume" or conditions.superseded:
            continue
        pairs = [(mine, theirs[mine.optimizer_update]) for mine in resumed.updates if mine.optimizer_update in theirs
                 and (window is None or boundary - window < mine.optimizer_update <= boundary + window)]
        diverged = next(((mine, ref) for mine, ref in pairs if (mine.digest, mine.num_samples) != (ref.digest,
                                                                                               ref.num_samples)), None)
        before = sum(1 for mine, _ in pairs if mine.optimizer_update <= boundary)
        where = (f"the resume at loop step {start.progress.step} (after optimizer update {boundary}, from "
                 f"{start.facts.resumed_from})")
        promised = start.facts.continuation or Continuation.SAMPLE_EXACT
        why = "".join(f"; {c.describe(f'at resume (step {start.progress.step})')}" for c in conditions.changes
                      if c.name in STREAM_FACTS)
        verdict: Continuation | None = promised
        if diverged is not None:
            mine, ref = diverged
            side = "after" if mine.optimizer_update > boundary else "before"
            message = (f"diverges at optimizer update {mine.optimizer_update} (loop step {mine.loop_step}), "
                       f"{abs(mine.optimizer_update - boundary)} update(s) {side} {where}: digest {mine.digest} of "
                       f"{mine.num_samples} samples vs reference {ref.digest} of {ref.num_samples}; the resume was "
                       f"{promised.value}{why}")
            if side == "before":
                message += "; the streams differ before the resume, so the runs differ in more than the resume"
            verdict = Continuation.NOT_EXACT
        elif before == len(pairs):
            message, verdict = (f"no sample digests to compare after {where} ({before} before): record update digests "
                                "in both runs and train the reference past the resume step"), None
        else:
            message = (f"{promised.value} around {where}: {before} update(s) before and {len(pairs) - before} after "
                       f"match the reference{why}")
        boundaries.append(BoundaryCheck(start.progress.step, boundary, before, len(pairs) - before, diverged, verdict,
                                        message))
    # The run's verdict is its worst boundary's: a divergence, then a boundary nothing verified, then the least exact.
    order = [Continuation.SAMPLE_EXACT, Continuation.GLOBAL_BATCH_EXACT, None, Continuation.NOT_EXACT]
    verdict = max((boundary.verdict for boundary in boundaries), key=order.index, default=None)
    return ResumeCheck(*run_labels([resumed, reference]), tuple(boundaries), verdict)
