"""Honest comparison of runs from their ledgers (docs/comparing-runs.md): equal loop steps can hide half the data
exposure and a clean resume can change the sample stream, so a comparison states each run's arithmetic behind the
step counter, which quantities the runs held fixed, the conditions of every start and resume, and (on request)
whether a resumed run's loaders delivered the reference run's samples. Runs that did not train on the same data
(another dataset, or another mixture of sources or weights) are not comparable, and the comparison says why
(``Comparability``); a mixture's runs also show what they drew from each source (``SourceExposure``).

Counts (sample presentations, optimizer updates, the effective batch) are held fixed only when they are equal.
A figure measured by the clock (the compute budget in worker-seconds) is never reproduced exactly, not even by the
same run twice, so it is held fixed when the runs' unrounded figures lie within a relative tolerance of each other
(``DEFAULT_TOLERANCE``, ``tolerance=`` on ``lerobot-mg-compare``); the report prints the figures and the tolerance.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from lerobot_mg.accounting.evals import RunEvals, run_evals
from lerobot_mg.accounting.ledger import RunRecord, StartRecord, UpdateDigest
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Continuation
from lerobot_mg.errors import ConfigError
from lerobot_mg.run_facts import (
    FactChange,
    MixtureDifference,
    Progress,
    RunFacts,
    describe,
    describe_count,
    describe_device,
    describe_mixture,
    mixture_differences,
    percent,
)

DEFAULT_TOLERANCE = 0.10  # relative: two figures measured by the clock within 10 % of each other are the same
# Changed at a resume, they change the sample stream.
STREAM_FACTS = ("batch", "topology", "dataset_fingerprint", "mixture")


class Quantity(str, Enum):
    """What two runs may hold fixed. Members are in report order."""

    DATA_EXPOSURE = "data exposure"  # sample presentations (total)
    UPDATE_COUNT = "update count"  # optimizer updates (total)
    EFFECTIVE_BATCH = "effective batch"
    COMPUTE_BUDGET = "compute budget"  # wall time x world size, measured by the clock

    @property
    def unit(self) -> str:
        return {Quantity.DATA_EXPOSURE: "sample presentations", Quantity.UPDATE_COUNT: "optimizer updates",
                Quantity.EFFECTIVE_BATCH: "samples per update", Quantity.COMPUTE_BUDGET: "worker-seconds"}[self]


HELD_FIXED_QUANTITIES = tuple(Quantity)


class Held(str, Enum):
    """The verdict on one quantity."""

    HELD = "held fixed"
    NOT_HELD = "not held fixed"
    UNKNOWN = "unknown"  # a figure measured by the clock that a run did not record


@dataclass(frozen=True)
class HeldFixed:
    """Whether the runs held one quantity fixed, and the figures that decided it.

    ``figures`` has one entry per run: the values the run went through, in order (more than one: it changed at a
    resume, so the run did not hold it fixed), unrounded. A count is held fixed when every run has one value and
    all are equal (``tolerance`` None). A figure measured by the clock is held fixed when the largest is at most
    ``tolerance`` (relative) above the smallest: ``max - min <= tolerance * min``.
    """

    quantity: Quantity
    figures: tuple[tuple[float, ...], ...]
    tolerance: float | None
    verdict: Held

    @property
    def held(self) -> bool:
        return self.verdict is Held.HELD

    @property
    def spread(self) -> float | None:
        """How far apart the runs' figures are, relative to the smallest (0.05: 5 %); None where unknown or a run
        changed its value."""
        values = [run[0] for run in self.figures if len(run) == 1]
        if len(values) < len(self.figures) or min(values) <= 0:
            return None
        return (max(values) - min(values)) / min(values)


def exact_count(quantity: Quantity, figures: Sequence[Sequence[int]]) -> HeldFixed:
    """The verdict on a count: held fixed when every run has one value and all are the same."""
    held = all(len(run) == 1 for run in figures) and _same([tuple(run) for run in figures])
    return HeldFixed(quantity, tuple(tuple(run) for run in figures), None, Held.HELD if held else Held.NOT_HELD)


def within_tolerance(quantity: Quantity, figures: Sequence[float], tolerance: float) -> HeldFixed:
    """The verdict on a figure measured by the clock, one per run: unknown when a run recorded none (0), else held
    fixed when ``max - min <= tolerance * min``."""
    smallest, largest = min(figures), max(figures)
    if smallest <= 0:
        verdict = Held.UNKNOWN
    else:
        verdict = Held.HELD if largest - smallest <= tolerance * smallest else Held.NOT_HELD
    return HeldFixed(quantity, tuple((figure,) for figure in figures), tolerance, verdict)


def clock_figure(seconds: float) -> str:
    """A figure measured by the clock for display: four significant digits at least, one decimal at least, so two
    figures the verdict tells apart do not print alike."""
    decimals = 1 if seconds <= 0 else max(1, 3 - math.floor(math.log10(seconds)))
    return f"{seconds:,.{decimals}f}"


@dataclass(frozen=True)
class SourceExposure:
    """What a run drew from one source of its dataset mixture over its effective run (the ledger's intervals)."""

    name: str
    samples: int
    share: float | None  # of every sample the run drew from its sources; None: its ledger recorded no draws
    weights: tuple[float, ...]  # the source's weight at the starts that had it, each distinct value in order


def source_exposure(record: RunRecord) -> tuple[SourceExposure, ...]:
    """Per source of the run's mixture (every source of any effective start, in order): the samples drawn and
    their share of all drawn. Empty for a single dataset."""
    mixtures = [segment.start.facts.mixture for segment in record.effective_segments
                if segment.start.facts.mixture is not None]
    samples = dict.fromkeys((source["name"] for mixture in mixtures for source in mixture), 0)
    for interval in record.intervals:
        for name, counts in interval.sources.items():
            samples[name] = samples.get(name, 0) + counts["samples"]
    total = sum(samples.values())
    return tuple(SourceExposure(name, drawn, drawn / total if total else None,
                                distinct([s["weight"] for mixture in mixtures for s in mixture if s["name"] == name]))
                 for name, drawn in samples.items())


# Ledgers written before the figures were renamed: the new key, then the old one.
OLD_METRIC_KEYS = {"samples_per_s": "samples/s", "peak_device_memory_gb": "gpu_peak_memory_gb"}
PHASES = ("dataloading_s", "preprocessing_s", "update_s")


@dataclass(frozen=True)
class Throughput:
    """One run's throughput figures (lerobot_mg.accounting.throughput), each the median over its intervals, the
    first interval of each start left out when that start logged more (it holds the start-up: DataLoader workers,
    compilation, the allocator's first growth); peak device memory the largest of every interval. None: no interval
    recorded it (a CPU has no MFU nor peak memory; an older ledger no phases)."""

    samples_per_s: float | None  # the cluster's
    samples_per_s_per_device: float | None
    mfu: float | None
    # Seconds per loop step: the slowest rank's, and rank 0's (what LeRobot logs).
    dataloading_s: float | None
    dataloading_s_rank0: float | None
    preprocessing_s: float | None
    preprocessing_s_rank0: float | None
    update_s: float | None
    update_s_rank0: float | None
    peak_device_memory_gb: float | None  # the largest over ranks and intervals
    flops_per_sample: tuple[int | None, ...]  # per distinct start value (model FLOPs, forward + backward)
    devices: tuple[str, ...]  # what each start trained on, in order (distinct)


def run_throughput(record: RunRecord) -> Throughput:
    """The throughput figures of ``record``'s effective run."""
    steady = []
    for segment in record.effective_segments:
        kept = segment.intervals[1:] if len(segment.intervals) > 1 else segment.intervals
        world_size = segment.start.facts.topology.world_size
        for interval in kept:
            metrics = {key: interval.metrics.get(key, interval.metrics.get(OLD_METRIC_KEYS.get(key, key)))
                       for key in (*OLD_METRIC_KEYS, "samples_per_s_per_device", "mfu", *PHASES,
                                   *(f"{phase}_rank0" for phase in PHASES))}
            if metrics["samples_per_s_per_device"] is None and metrics["samples_per_s"] is not None:
                metrics["samples_per_s_per_device"] = metrics["samples_per_s"] / world_size
            steady.append(metrics)

    def median(key: str) -> float | None:
        values = [metrics[key] for metrics in steady if metrics[key] is not None]
        return statistics.median(values) if values else None

    peaks = [peak for interval in record.intervals if (peak := interval.metrics.get(
        "peak_device_memory_gb", interval.metrics.get(OLD_METRIC_KEYS["peak_device_memory_gb"]))) is not None]
    facts = [segment.start.facts for segment in record.effective_segments]
    return Throughput(
        *(median(key) for key in ("samples_per_s", "samples_per_s_per_device", "mfu", "dataloading_s",
                                  "dataloading_s_rank0", "preprocessing_s", "preprocessing_s_rank0", "update_s",
                                  "update_s_rank0")),
        max(peaks) if peaks else None, distinct([f.flops_per_sample for f in facts]),
        distinct([describe_device(f.device) for f in facts]))


def throughput_rows(runs: Sequence[RunSummary]) -> list[tuple[str, tuple[str, ...]]]:
    """The comparison table's throughput rows, one cell per run (``-``: not recorded)."""

    def cells(figure: Any) -> tuple[str, ...]:
        return tuple(figure(run.throughput) for run in runs)

    def number(value: float | None, spec: str = ".4g") -> str:
        return "-" if value is None else format(value, spec)

    def phase(name: str) -> Any:
        return lambda t: ("-" if getattr(t, name) is None else
                          f"{number(getattr(t, name))} (rank 0 {number(getattr(t, f'{name}_rank0'))})")

    return [("samples/s (cluster)", cells(lambda t: number(t.samples_per_s))),
            ("samples/s per device", cells(lambda t: number(t.samples_per_s_per_device))),
            ("MFU", cells(lambda t: "-" if t.mfu is None else f"{100 * t.mfu:.3g} %")),
            ("data wait s/step, slowest rank", cells(phase("dataloading_s"))),
            ("preprocessing s/step, slowest rank", cells(phase("preprocessing_s"))),
            ("update s/step, slowest rank", cells(phase("update_s"))),
            ("peak device memory (GB)", cells(lambda t: number(t.peak_device_memory_gb, ".3f"))),
            ("model FLOPs per sample", cells(lambda t: " -> ".join(describe_count(f, "FLOP")
                                                                    for f in t.flops_per_sample))),
            ("device", cells(lambda t: " -> ".join(t.devices)))]


class DataMismatch(str, Enum):
    """Why two runs did not train on the same data."""

    DATASET = "dataset"  # the dataset fingerprints differ (a single dataset each, or one of them a mixture)
    MIXTURE = "mixture"  # both trained on mixtures, of other sources, source data or weights
    CHANGED = "changed at a resume"  # a run's own data changed at one of its resumes


@dataclass(frozen=True)
class DataDifference:
    """One reason runs are not comparable. ``run`` differs from ``reference`` (the first run), or for
    ``CHANGED``, from its own data before its resume at ``loop_step``. ``fingerprints``: the dataset fingerprints
    before and after; ``sources``: how the mixture changed, source by source (``MIXTURE``, ``CHANGED``)."""

    mismatch: DataMismatch
    run: str
    reference: str | None
    loop_step: int | None
    fingerprints: tuple[str, str]
    sources: tuple[MixtureDifference, ...] = ()

    def describe(self) -> str:
        detail = ("; ".join(difference.describe() for difference in self.sources) if self.sources else
                  f"dataset {self.fingerprints[0]} -> {self.fingerprints[1]}")
        if self.mismatch is DataMismatch.CHANGED:
            return f"{self.run}: the training data changed at its resume at loop step {self.loop_step:,}: {detail}"
        if self.mismatch is DataMismatch.MIXTURE:
            return f"mixture differs between runs, {self.reference} -> {self.run}: {detail}"
        return f"dataset differs between runs: {self.reference} {self.fingerprints[0]}, {self.run} {self.fingerprints[1]}"


@dataclass(frozen=True)
class Comparability:
    """Whether the runs trained on the same data: the same dataset, or the same mixture (the same sources, with
    the same data and weights; where each was read from does not count), throughout. Only then can their curves
    be compared at all; what else they held fixed is ``Comparison.held_fixed``."""

    comparable: bool
    differences: tuple[DataDifference, ...]  # empty when comparable
    data: tuple[str, ...]  # each run's data, as its first effective start recorded it


def _data_differences(facts: RunFacts, other: RunFacts, run: str, reference: str | None,
                      loop_step: int | None, mismatch: DataMismatch | None) -> list[DataDifference]:
    """How ``other``'s data differs from ``facts``'s. Two mixtures: source by source only, in any order (names, each
    source's data fingerprint, frames and episodes, and weights within
    :data:`lerobot_mg.run_facts.WEIGHT_TOLERANCE`); their dataset fingerprints are not compared, since a mixture's
    depends on the sources' order and names, and sources in another order draw the same distribution of samples.
    Otherwise (a single dataset on either side) by the dataset fingerprint."""
    fingerprints = (facts.dataset_fingerprint, other.dataset_fingerprint)
    if facts.mixture is not None and other.mixture is not None:
        sources = mixture_differences(facts.mixture, other.mixture, ordered=False)
        if sources:
            return [DataDifference(mismatch or DataMismatch.MIXTURE, run, reference, loop_step, fingerprints, sources)]
        return []
    if fingerprints[0] != fingerprints[1]:
        return [DataDifference(mismatch or DataMismatch.DATASET, run, reference, loop_step, fingerprints)]
    return []


def comparability(records: Sequence[RunRecord], labels: Sequence[str]) -> Comparability:
    """The verdict on the runs' data: each run against the first, and each run against itself at its resumes."""
    starts = [[segment.start for segment in record.effective_segments] for record in records]
    differences = [difference for label, run in zip(labels, starts) for before, after in zip(run, run[1:])
                   for difference in _data_differences(before.facts, after.facts, label, None, after.progress.step,
                                                       DataMismatch.CHANGED)]
    differences += [difference for label, run in zip(labels[1:], starts[1:])
                    for difference in _data_differences(starts[0][0].facts, run[0].facts, label, labels[0], None, None)]
    data = tuple(run[0].facts.dataset_fingerprint + (f" = mixture {describe_mixture(run[0].facts.mixture)}"
                                                       if run[0].facts.mixture is not None else "") for run in starts)
    return Comparability(not differences, tuple(differences), data)


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
    exposure: tuple[SourceExposure, ...] = ()  # per source of a dataset mixture; empty for a single dataset
    throughput: Throughput | None = None  # samples/s, MFU, per-step phase seconds, peak memory (run_throughput)


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
    comparability: Comparability  # whether the runs trained on the same data (else, why not)
    table: tuple[tuple[str, tuple[str, ...]], ...]  # (quantity, one cell per run)
    held_fixed: dict[Quantity, HeldFixed]  # every Quantity, in report order
    same_lr_schedule: bool
    same_accumulation: bool
    differences: tuple[str, ...]
    conditions: dict[str, tuple[StartConditions, ...]]
    cross_run_flags: tuple[str, ...]
    evals: dict[str, RunEvals]  # each run's best evaluations (label -> its evals)


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


def source_names(runs: Sequence[RunSummary]) -> tuple[str, ...]:
    """Every source any run drew from, in the order the runs list them."""
    return tuple(dict.fromkeys(exposure.name for run in runs for exposure in run.exposure))


def exposure_cells(runs: Sequence[RunSummary], name: str) -> tuple[str, ...]:
    """Per run: the samples drawn from source ``name``, their share of the run's draws, and the source's weight
    (the share the run asked for); ``-`` where the run had no such source."""

    def cell(exposure: SourceExposure | None) -> str:
        if exposure is None:
            return "-"
        weight = f"weight {' -> '.join(percent(weight) for weight in exposure.weights)}"
        if exposure.share is None:
            return f"not recorded ({weight})"
        return f"{exposure.samples:,} = {percent(exposure.share)} ({weight})"

    return tuple(cell(next((e for e in run.exposure if e.name == name), None)) for run in runs)


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
        source_exposure(record), run_throughput(record),
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


def compare_runs(records: Sequence[RunRecord], tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    """Compare runs on their arithmetic; ``records`` come from ``read_ledger``, at least two. ``tolerance`` is
    relative, for the figures measured by the clock (0.1: within 10 % of each other they are held fixed)."""
    if len(records) < 2:
        raise ConfigError(f"run_dirs={[str(r.run_dir) for r in records]}: comparing runs needs at least two run "
                          "directories. Fix: lerobot-mg-compare <run dir> <run dir> [...]")
    if not 0 <= tolerance < math.inf:
        raise ConfigError(f"tolerance={tolerance}: must be a relative tolerance >= 0 (0.1 is 10 %). "
                          f"Fix: tolerance={DEFAULT_TOLERANCE}")
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
            *((f"samples from {name} (total)", exposure_cells(runs, name), False) for name in source_names(runs)),
            ("lr schedule", tuple(joined(r.lr_schedules) for r in runs), True),
            ("final lr", tuple("-" if r.final_lr is None else f"{r.final_lr:.4g}" for r in runs), False),
            ("final loss", tuple("-" if r.final_loss is None else f"{r.final_loss:.4g}" for r in runs), False),
            ("wall time (s)", tuple(clock_figure(r.wall_time_s) for r in runs), False),
            ("compute budget (worker-s)", tuple(clock_figure(r.compute_budget_worker_s) for r in runs), False),
            *((name, cells, False) for name, cells in throughput_rows(runs))]

    def listing(values: Sequence[Any]) -> str:
        return ", ".join(f"{label} {value}" for label, value in zip(labels, values))

    differences = [f"{name} differs: {listing(cells)}" for name, cells, named in rows if named and not _same(cells)]
    verdicts = (exact_count(Quantity.DATA_EXPOSURE, [(r.total.samples_seen,) for r in runs]),
                exact_count(Quantity.UPDATE_COUNT, [(r.total.optimizer_updates,) for r in runs]),
                exact_count(Quantity.EFFECTIVE_BATCH,
                            [distinct([a.effective_batch_size for a in r.arithmetic]) for r in runs]),
                within_tolerance(Quantity.COMPUTE_BUDGET, [r.compute_budget_worker_s for r in runs], tolerance))
    first = [record.segments[0].start.facts for record in records]
    cross_run = [("code revision", [f.code_revision.describe() for f in first]),
                 ("checkpoint format", [f.checkpoint_format for f in first])]
    return Comparison(
        runs=runs, shared_loop_step=step, comparability=comparability(records, labels),
        table=tuple((name, cells) for name, cells, _ in rows),
        held_fixed={verdict.quantity: verdict for verdict in verdicts},
        same_lr_schedule=all(len(r.lr_schedules) == 1 for r in runs) and _same([r.lr_schedules for r in runs]),
        same_accumulation=_same([distinct([a.grad_accum_steps for a in r.arithmetic]) for r in runs]),
        differences=tuple(differences),
        conditions={label: start_conditions(record) for record, label in zip(records, labels)},
        cross_run_flags=tuple(f"{name} differs between runs: {listing(values)}"
                              for name, values in cross_run if not _same(values)),
        evals={label: run_evals(record) for record, label in zip(records, labels)},
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
        raise ConfigError(f"run_dirs={[str(r.run_dir) for r in records]}: check_resume compares exactly two runs (a "
                          "resumed run and a reference). Fix: lerobot-mg-compare <resumed run> <reference run> "
                          "check_resume=true")
    for position, record in enumerate(records):
        if any(segment.start.kind == "resume" for segment in record.effective_segments):
            return record, records[1 - position]
    raise ConfigError(f"run_dirs={[str(records[0].run_dir), str(records[1].run_dir)]}: check_resume needs a resumed "
                     "run, and neither ledger has a resume record. Fix: pass a run that was resumed (resume=true) "
                     "and its reference, or drop check_resume")


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
