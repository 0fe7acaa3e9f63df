"""Honest comparison of runs from their ledgers: batch arithmetic, what was held fixed, resume conditions.

seeds/comparing-runs.md: equal loop steps can hide half the data exposure, and a clean resume can still
change the sample stream. So a comparison states, per run, the arithmetic behind the step counter, which of
{data exposure, update count, effective batch, compute budget} the runs actually held fixed, the conditions
of every start and resume, and (on request) whether a resumed run saw the same samples as a reference run.
Everything here reads only the ledger, so it works the same on synthetic and on real runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lerobot_mg.accounting.ledger import BatchArithmetic, RunRecord, Segment, StartRecord

HELD_FIXED_QUANTITIES = ("data exposure", "update count", "effective batch", "compute budget")
# Wall time is never reproduced exactly; within this relative spread two budgets count as the same.
COMPUTE_BUDGET_TOLERANCE = 0.10
SAMPLE_EXACT = "sample-exact"
DIVERGED = "diverged"
UNVERIFIED = "unverified"


@dataclass(frozen=True)
class Counts:
    """Sample presentations and optimizer updates at one loop step; `exact` is False when derived."""

    loop_step: int
    samples_seen: int
    optimizer_updates: int
    exact: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "loop_step": self.loop_step,
            "samples_seen": self.samples_seen,
            "optimizer_updates": self.optimizer_updates,
            "exact": self.exact,
        }


@dataclass(frozen=True)
class RunSummary:
    """One run's arithmetic. Tuples hold each distinct value in order (more than one: changed at resume)."""

    label: str
    run_dir: Path
    arithmetic: tuple[BatchArithmetic, ...]
    world_sizes: tuple[int, ...]
    lr_schedules: tuple[dict, ...]
    precisions: tuple[str, ...]
    total: Counts
    shared: Counts
    final_lr: float | None
    final_loss: float | None
    wall_time_s: float
    compute_budget_worker_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "run_dir": str(self.run_dir),
            "arithmetic": [a.as_dict() for a in self.arithmetic],
            "world_sizes": list(self.world_sizes),
            "lr_schedules": list(self.lr_schedules),
            "precisions": list(self.precisions),
            "total": self.total.to_json(),
            "shared": self.shared.to_json(),
            "final_lr": self.final_lr,
            "final_loss": self.final_loss,
            "wall_time_s": self.wall_time_s,
            "compute_budget_worker_s": self.compute_budget_worker_s,
        }


@dataclass(frozen=True)
class SegmentConditions:
    """The conditions one start or resume ran under, and what changed against the previous attempt."""

    kind: str
    loop_step: int
    optimizer_updates: int
    resumed_from: str | None
    code_revision: dict
    topology: dict
    world_size: int
    arithmetic: BatchArithmetic
    precision: str
    dataset_fingerprint: str
    checkpoint_format: str
    lr_schedule: dict
    sampler_continuation: str | None
    superseded: bool
    flags: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "loop_step": self.loop_step,
            "optimizer_updates": self.optimizer_updates,
            "resumed_from": self.resumed_from,
            "code_revision": self.code_revision,
            "topology": self.topology,
            "world_size": self.world_size,
            "arithmetic": self.arithmetic.as_dict(),
            "precision": self.precision,
            "dataset_fingerprint": self.dataset_fingerprint,
            "checkpoint_format": self.checkpoint_format,
            "lr_schedule": self.lr_schedule,
            "sampler_continuation": self.sampler_continuation,
            "superseded": self.superseded,
            "flags": list(self.flags),
        }


@dataclass(frozen=True)
class Comparison:
    runs: tuple[RunSummary, ...]
    shared_loop_step: int
    held_fixed: dict[str, bool]
    same_lr_schedule: bool
    same_accumulation: bool
    differences: tuple[str, ...]
    conditions: dict[str, tuple[SegmentConditions, ...]]
    cross_run_flags: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": [run.to_json() for run in self.runs],
            "shared_loop_step": self.shared_loop_step,
            "held_fixed": self.held_fixed,
            "same_lr_schedule": self.same_lr_schedule,
            "same_accumulation": self.same_accumulation,
            "differences": list(self.differences),
            "resume_conditions": {
                label: [segment.to_json() for segment in segments]
                for label, segments in self.conditions.items()
            },
            "cross_run_flags": list(self.cross_run_flags),
        }


def run_labels(records: Sequence[RunRecord]) -> list[str]:
    """Short unique names: the run directory's name, with its parent's when two names collide."""
    names = [record.run_dir.name for record in records]
    labels = [
        f"{record.run_dir.parent.name}/{name}" if names.count(name) > 1 else name
        for record, name in zip(records, names)
    ]
    if len(set(labels)) != len(labels):
        labels = [str(record.run_dir) for record in records]
    return labels


def _distinct(values: Sequence[Any]) -> tuple[Any, ...]:
    """Values in order, consecutive repeats dropped (what a run went through)."""
    distinct: list[Any] = []
    for value in values:
        if not distinct or distinct[-1] != value:
            distinct.append(value)
    return tuple(distinct)


def counts_at(record: RunRecord, loop_step: int) -> Counts:
    """Counts at `loop_step`: as recorded when an interval was logged there, else derived from the last
    record before it with the batch arithmetic in force (assuming full microbatches)."""
    segment = record.segment_at(loop_step)
    for interval in segment.intervals:
        if interval.loop_step == loop_step:
            return Counts(loop_step, interval.samples_seen, interval.optimizer_updates, exact=True)
    start = segment.start
    if loop_step == start.loop_step:
        return Counts(loop_step, start.samples_seen, start.optimizer_updates, exact=True)
    base_step, base_samples, base_updates = start.loop_step, start.samples_seen, start.optimizer_updates
    for interval in segment.intervals:
        if interval.loop_step < loop_step:
            base_step, base_samples, base_updates = (
                interval.loop_step,
                interval.samples_seen,
                interval.optimizer_updates,
            )
    arithmetic = start.arithmetic
    # Updates fall on loop steps that are multiples of the accumulation (the accumulation boundary).
    updates = (
        base_updates + loop_step // arithmetic.grad_accum_steps - base_step // arithmetic.grad_accum_steps
    )
    samples = base_samples + arithmetic.sample_presentations(loop_step - base_step)
    return Counts(loop_step, samples, updates, exact=False)


def _total_counts(record: RunRecord) -> Counts:
    final = record.final_interval
    if final is not None:
        return Counts(final.loop_step, final.samples_seen, final.optimizer_updates, exact=True)
    start = record.effective_segments[-1].start
    return Counts(start.loop_step, start.samples_seen, start.optimizer_updates, exact=True)


def summarize_run(record: RunRecord, label: str, shared_loop_step: int) -> RunSummary:
    effective = record.effective_segments
    final = record.final_interval
    compute_budget = sum(s.intervals[-1].wall_time_s * s.start.world_size for s in effective if s.intervals)
    return RunSummary(
        label=label,
        run_dir=record.run_dir,
        arithmetic=_distinct([s.start.arithmetic for s in effective]),
        world_sizes=_distinct([s.start.world_size for s in effective]),
        lr_schedules=_distinct([s.start.lr_schedule for s in effective]),
        precisions=_distinct([s.start.precision for s in effective]),
        total=_total_counts(record),
        shared=counts_at(record, shared_loop_step),
        final_lr=None if final is None else final.lr,
        final_loss=None if final is None else final.loss,
        wall_time_s=record.total_wall_time_s,
        compute_budget_worker_s=compute_budget,
    )


def format_revision(revision: dict) -> str:
    commit = revision.get("commit")
    dirty = revision.get("dirty")
    text = "unknown" if commit is None else str(commit)[:12]
    if dirty:
        text += " (dirty)"
    elif dirty is None:
        text += " (dirty: unknown)"
    return text


def format_schedule(schedule: dict) -> str:
    parts = [str(schedule.get("type", "?"))]
    parts += [f"{key}={value}" for key, value in schedule.items() if key != "type"]
    return " ".join(parts)


def _topology_text(topology: dict) -> str:
    return json.dumps(topology, sort_keys=True)


def segment_conditions(record: RunRecord) -> tuple[SegmentConditions, ...]:
    """Every start and resume of a run, with flags for what changed against the attempt before it."""
    conditions: list[SegmentConditions] = []
    previous: Segment | None = None
    for segment in record.segments:
        start = segment.start
        flags = _start_flags(start)
        if previous is not None:
            flags += _change_flags(previous, start)
        conditions.append(
            SegmentConditions(
                kind=start.kind,
                loop_step=start.loop_step,
                optimizer_updates=start.optimizer_updates,
                resumed_from=start.resumed_from,
                code_revision=start.code_revision,
                topology=start.topology,
                world_size=start.world_size,
                arithmetic=start.arithmetic,
                precision=start.precision,
                dataset_fingerprint=start.dataset_fingerprint,
                checkpoint_format=start.checkpoint_format,
                lr_schedule=start.lr_schedule,
                sampler_continuation=start.sampler_continuation,
                superseded=record.superseded(segment),
                flags=tuple(flags),
            )
        )
        previous = segment
    return tuple(conditions)


def _start_flags(start: StartRecord) -> list[str]:
    revision = start.code_revision
    if revision.get("commit") is None:
        return [
            f"code revision unknown at {start.kind} (step {start.loop_step}): not run from a git checkout"
        ]
    if revision.get("dirty"):
        return [
            f"uncommitted changes at {start.kind} (step {start.loop_step}): commit "
            f"{format_revision(revision)} does not pin the code that ran"
        ]
    return []


def _change_flags(previous: Segment, start: StartRecord) -> list[str]:
    before = previous.start
    at = f"at {start.kind} (step {start.loop_step})"
    flags: list[str] = []
    reached = max(
        [before.loop_step]
        + [r.loop_step for r in previous.intervals]
        + [r.loop_step for r in previous.updates]
    )
    if start.kind == "resume" and reached > start.loop_step:
        flags.append(
            f"steps {start.loop_step + 1}-{reached} re-run {at}: the previous attempt reached step {reached}; "
            "its records past the resume step are superseded"
        )
    if start.topology != before.topology:
        flags.append(
            f"topology changed {at}: {_topology_text(before.topology)} -> {_topology_text(start.topology)}"
        )
    if start.world_size != before.world_size:
        flags.append(f"world size changed {at}: {before.world_size} -> {start.world_size}")
    if start.arithmetic != before.arithmetic:
        flags.append(f"batch changed {at}: {before.arithmetic.banner()} -> {start.arithmetic.banner()}")
    if start.precision != before.precision:
        flags.append(f"precision changed {at}: {before.precision} -> {start.precision}")
    if start.code_revision != before.code_revision:
        flags.append(
            f"code revision changed {at}: {format_revision(before.code_revision)} -> "
            f"{format_revision(start.code_revision)}"
        )
    if start.dataset_fingerprint != before.dataset_fingerprint:
        flags.append(f"dataset changed {at}: {before.dataset_fingerprint} -> {start.dataset_fingerprint}")
    if start.checkpoint_format != before.checkpoint_format:
        flags.append(
            f"checkpoint format changed {at}: {before.checkpoint_format} -> {start.checkpoint_format}"
        )
    if start.lr_schedule != before.lr_schedule:
        flags.append(
            f"lr schedule changed {at}: {format_schedule(before.lr_schedule)} -> "
            f"{format_schedule(start.lr_schedule)}"
        )
    return flags


def _all_equal(values: Sequence[Any]) -> bool:
    return all(value == values[0] for value in values[1:])


def _listing(labels: Sequence[str], values: Sequence[Any]) -> str:
    return ", ".join(f"{label} {value}" for label, value in zip(labels, values))


def compare_runs(records: Sequence[RunRecord]) -> Comparison:
    """Compare runs on their arithmetic; `records` come from `read_ledger`, at least two."""
    if len(records) < 2:
        raise ValueError(f"comparing runs needs at least two run directories, got {len(records)}.")
    labels = run_labels(records)
    shared_loop_step = min(_total_counts(record).loop_step for record in records)
    runs = tuple(summarize_run(r, label, shared_loop_step) for r, label in zip(records, labels))

    samples = [run.total.samples_seen for run in runs]
    updates = [run.total.optimizer_updates for run in runs]
    effective_batches = [_distinct([a.effective_batch_size for a in run.arithmetic]) for run in runs]
    budgets = [run.compute_budget_worker_s for run in runs]
    budgets_known = min(budgets) > 0
    held_fixed = {
        "data exposure": _all_equal(samples),
        "update count": _all_equal(updates),
        "effective batch": all(len(b) == 1 for b in effective_batches) and _all_equal(effective_batches),
        "compute budget": budgets_known and max(budgets) <= min(budgets) * (1 + COMPUTE_BUDGET_TOLERANCE),
    }
    same_lr_schedule = all(len(run.lr_schedules) == 1 for run in runs) and _all_equal(
        [run.lr_schedules for run in runs]
    )
    accumulations = [_distinct([a.grad_accum_steps for a in run.arithmetic]) for run in runs]
    same_accumulation = _all_equal(accumulations)

    differences: list[str] = []

    def note(name: str, values: Sequence[Any]) -> None:
        if not _all_equal(values):
            differences.append(f"{name} differs: {_listing(labels, values)}")

    note(
        "microbatch per worker", [_joined(_distinct([a.batch_size for a in run.arithmetic])) for run in runs]
    )
    note(
        "data-parallel workers",
        [_joined(_distinct([a.dp_world_size for a in run.arithmetic])) for run in runs],
    )
    note("accumulation steps", [_joined(accumulation) for accumulation in accumulations])
    note("effective batch (data exposure per update)", [_joined(b) for b in effective_batches])
    note("loop steps", [run.total.loop_step for run in runs])
    note("sample presentations (data exposure)", samples)
    note("optimizer updates (update count)", updates)
    note(
        f"sample presentations over the shared {shared_loop_step} loop steps",
        [r.shared.samples_seen for r in runs],
    )
    note(
        f"optimizer updates over the shared {shared_loop_step} loop steps",
        [r.shared.optimizer_updates for r in runs],
    )
    note("lr schedule", [" -> ".join(format_schedule(s) for s in run.lr_schedules) for run in runs])
    note("precision", [_joined(run.precisions) for run in runs])
    if not budgets_known:
        differences.append("compute budget unknown: a run logged no interval with wall time")
    elif not held_fixed["compute budget"]:
        differences.append(
            f"compute budget (worker-seconds) differs by more than {COMPUTE_BUDGET_TOLERANCE:.0%}: "
            f"{_listing(labels, [f'{b:.1f}' for b in budgets])}"
        )

    first_starts = [record.first_start for record in records]
    cross_run_flags: list[str] = []
    for name, values in (
        ("code revision", [format_revision(s.code_revision) for s in first_starts]),
        ("dataset", [s.dataset_fingerprint for s in first_starts]),
        ("checkpoint format", [s.checkpoint_format for s in first_starts]),
    ):
        if not _all_equal(values):
            cross_run_flags.append(f"{name} differs between runs: {_listing(labels, values)}")

    return Comparison(
        runs=runs,
        shared_loop_step=shared_loop_step,
        held_fixed=held_fixed,
        same_lr_schedule=same_lr_schedule,
        same_accumulation=same_accumulation,
        differences=tuple(differences),
        conditions={label: segment_conditions(record) for record, label in zip(records, labels)},
        cross_run_flags=tuple(cross_run_flags),
    )


def _joined(values: Any) -> str:
    return " -> ".join(str(value) for value in values)


# ----------------------------------------------------------------------------------------------------------
# Sample order around a resume


@dataclass(frozen=True)
class Divergence:
    optimizer_update: int
    loop_step: int
    resumed_digest: str
    reference_digest: str
    resumed_num_samples: int
    reference_num_samples: int

    def to_json(self) -> dict[str, Any]:
        return {
            "optimizer_update": self.optimizer_update,
            "loop_step": self.loop_step,
            "resumed_digest": self.resumed_digest,
            "reference_digest": self.reference_digest,
            "resumed_num_samples": self.resumed_num_samples,
            "reference_num_samples": self.reference_num_samples,
        }


@dataclass(frozen=True)
class BoundaryCheck:
    loop_step: int
    optimizer_update: int
    resumed_from: str | None
    num_compared_before: int
    num_compared_after: int
    first_divergence: Divergence | None
    verdict: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "loop_step": self.loop_step,
            "optimizer_update": self.optimizer_update,
            "resumed_from": self.resumed_from,
            "num_compared_before": self.num_compared_before,
            "num_compared_after": self.num_compared_after,
            "first_divergence": None if self.first_divergence is None else self.first_divergence.to_json(),
            "verdict": self.verdict,
            "message": self.message,
        }


@dataclass(frozen=True)
class ResumeCheck:
    resumed: str
    reference: str
    boundaries: tuple[BoundaryCheck, ...]
    verdict: str

    @property
    def sample_exact(self) -> bool:
        return self.verdict == SAMPLE_EXACT

    def to_json(self) -> dict[str, Any]:
        return {
            "resumed": self.resumed,
            "reference": self.reference,
            "verdict": self.verdict,
            "sample_exact": self.sample_exact,
            "boundaries": [boundary.to_json() for boundary in self.boundaries],
        }


def pick_resumed_run(records: Sequence[RunRecord]) -> tuple[RunRecord, RunRecord]:
    """(resumed, reference) for `--check-resume`: the first run with a resume is the resumed one."""
    if len(records) != 2:
        raise ValueError(
            f"--check-resume compares exactly two runs (a resumed run and a reference run), got {len(records)}."
        )
    for position, record in enumerate(records):
        if any(segment.start.kind == "resume" for segment in record.effective_segments):
            return record, records[1 - position]
    raise ValueError(
        f"--check-resume needs a resumed run, but neither {records[0].run_dir} nor {records[1].run_dir} "
        "has a resume record in its ledger."
    )


def check_resume(resumed: RunRecord, reference: RunRecord, window: int | None = None) -> ResumeCheck:
    """Compare the per-update sample digests of `resumed` and `reference` around each resume boundary.

    Updates are matched by optimizer update number. `window` limits the comparison to that many updates
    on either side of a boundary; None compares every update both ledgers hold.
    """
    if window is not None and window < 1:
        raise ValueError(f"--window must be a positive number of optimizer updates, got {window}.")
    reference_updates = {update.optimizer_update: update for update in reference.updates}
    resumed_updates = sorted(resumed.updates, key=lambda update: update.optimizer_update)
    conditions = segment_conditions(resumed)
    boundaries: list[BoundaryCheck] = []
    for segment, condition in zip(resumed.segments, conditions):
        start = segment.start
        if start.kind != "resume" or condition.superseded:
            continue
        boundary = start.optimizer_updates
        compared = [
            (update, reference_updates[update.optimizer_update])
            for update in resumed_updates
            if update.optimizer_update in reference_updates
            and (window is None or boundary - window < update.optimizer_update <= boundary + window)
        ]
        divergence = next(
            (
                Divergence(
                    mine.optimizer_update,
                    mine.loop_step,
                    mine.digest,
                    ref.digest,
                    mine.num_samples,
                    ref.num_samples,
                )
                for mine, ref in compared
                if mine.digest != ref.digest or mine.num_samples != ref.num_samples
            ),
            None,
        )
        num_before = sum(1 for mine, _ in compared if mine.optimizer_update <= boundary)
        num_after = len(compared) - num_before
        verdict, message = _boundary_verdict(start, condition, boundary, divergence, num_before, num_after)
        boundaries.append(
            BoundaryCheck(
                loop_step=start.loop_step,
                optimizer_update=boundary,
                resumed_from=start.resumed_from,
                num_compared_before=num_before,
                num_compared_after=num_after,
                first_divergence=divergence,
                verdict=verdict,
                message=message,
            )
        )
    verdicts = {boundary.verdict for boundary in boundaries}
    overall = DIVERGED if DIVERGED in verdicts else UNVERIFIED if UNVERIFIED in verdicts else SAMPLE_EXACT
    if not boundaries:
        overall = UNVERIFIED
    labels = run_labels([resumed, reference])
    return ResumeCheck(resumed=labels[0], reference=labels[1], boundaries=tuple(boundaries), verdict=overall)


def _boundary_verdict(
    start: StartRecord,
    condition: SegmentConditions,
    boundary: int,
    divergence: Divergence | None,
    num_before: int,
    num_after: int,
) -> tuple[str, str]:
    where = (
        f"the resume at loop step {start.loop_step} (after optimizer update {boundary}, "
        f"from {start.resumed_from})"
    )
    causes = [
        flag
        for flag in condition.flags
        if flag.startswith(("world size changed", "batch changed", "topology changed", "dataset changed"))
    ]
    hint = ""
    if causes:
        hint = (
            "; " + "; ".join(causes) + " (the guide promises sample-exact continuation only "
            "when world size and batch size match the original run)"
        )
    if divergence is not None:
        side = "after" if divergence.optimizer_update > boundary else "before"
        offset = abs(divergence.optimizer_update - boundary)
        message = (
            f"diverges at optimizer update {divergence.optimizer_update} (loop step {divergence.loop_step}), "
            f"{offset} update(s) {side} {where}: digest {divergence.resumed_digest} vs reference "
            f"{divergence.reference_digest}"
        )
        if side == "before":
            message += "; the streams differ before the resume, so the runs differ in more than the resume"
        return DIVERGED, message + hint
    if num_after == 0:
        return UNVERIFIED, (
            f"no sample digests to compare after {where} ({num_before} before): record update digests in "
            "both runs and train the reference past the resume step"
        )
    return SAMPLE_EXACT, (
        f"sample-exact around {where}: {num_before} update(s) before and {num_after} after match the reference"
    )
