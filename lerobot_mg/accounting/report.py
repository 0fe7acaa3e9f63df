"""A run comparison as a console table, Markdown, learning-curve PNG or JSON (``lerobot-mg-compare``). The curves
(the training loss, and where the runs evaluated, the success rate in simulation and the validation loss) are drawn
against loop steps, sample presentations and optimizer updates, because a curve that leads on one axis can trail on
another (docs/comparing-runs.md); the Markdown puts the arithmetic table beside them for that reason. Every format
leads with the verdict on the runs' data: runs that trained on different data are not comparable."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lerobot_mg.accounting.compare import (
    HELD_FIXED_QUANTITIES,
    Comparison,
    Held,
    HeldFixed,
    ResumeCheck,
    clock_figure,
    run_labels,
)
from lerobot_mg.accounting.ledger import RunRecord

THROUGHPUT_NOTE = ("throughput rows: medians over each run's log intervals, the first of each start left out; seconds "
                   "are per loop step, the slowest rank's with rank 0's beside them; MFU only on a GPU the peak table "
                   "lists (docs/comparing-runs.md)")
_CURVE_AXES = (("step", "loop steps"), ("samples_seen", "sample presentations"),
               ("optimizer_updates", "optimizer updates"))


def tolerance_line(verdict: HeldFixed, labels: Sequence[str]) -> str:
    """The verdict on a figure measured by the clock, with every run's figure and the tolerance that decided it."""
    name = f"{verdict.quantity.value} ({verdict.quantity.unit})"
    figures = ", ".join(f"{label} {clock_figure(value)}" for label, (value, *_) in zip(labels, verdict.figures))
    if verdict.verdict is Held.UNKNOWN or verdict.spread is None or verdict.tolerance is None:
        return f"{name} unknown: {figures}; a run logged no interval with wall time"
    tolerance = f"the tolerance of {verdict.tolerance * 100:g} % (tolerance={verdict.tolerance:g})"
    if verdict.held:
        return f"{name} held fixed: {figures}, {verdict.spread * 100:.2f} % apart, within {tolerance}"
    return f"{name} not held fixed: {figures}, {verdict.spread * 100:.2f} % apart, more than {tolerance}"


def comparability_lines(comparison: Comparison) -> list[str]:
    """The verdict on the runs' data: the first line says whether they are comparable, the rest why not."""
    verdict = comparison.comparability
    if verdict.comparable:
        return [f"comparable: yes, every run trained on the same data: {verdict.data[0]}"]
    return ["comparable: NO, the runs did not train on the same data, so their curves say nothing about the rest:",
            *(f"  {difference.describe()}" for difference in verdict.differences)]


def held_fixed_lines(comparison: Comparison) -> list[str]:
    verdicts = [comparison.held_fixed[quantity] for quantity in HELD_FIXED_QUANTITIES]
    held = [verdict.quantity.value for verdict in verdicts if verdict.held]
    varied = [verdict.quantity.value for verdict in verdicts if not verdict.held]
    labels = [run.label for run in comparison.runs]
    everything = ", ".join(quantity.value for quantity in HELD_FIXED_QUANTITIES)
    return [f"held fixed: {', '.join(held) or 'none of ' + everything}",
            f"not held fixed: {', '.join(varied) or 'none'}",
            *(tolerance_line(verdict, labels) for verdict in verdicts if verdict.tolerance is not None),
            f"same lr schedule: {'yes' if comparison.same_lr_schedule else 'no'}; "
            f"same accumulation boundary: {'yes' if comparison.same_accumulation else 'no'}"]


def condition_lines(comparison: Comparison) -> list[str]:
    lines: list[str] = []
    for label, conditions in comparison.conditions.items():
        lines.append(f"{label}:")
        for condition in conditions:
            start, facts = condition.start, condition.start.facts
            why = f" ({facts.resume_cause.value})" if facts.resume_cause else ""
            origin = f" from {facts.resumed_from}{why}: {facts.continuation.value}" if facts.continuation else ""
            lines.append(f"  {start.kind} at loop step {start.progress.step:,} (update "
                         f"{start.progress.optimizer_updates:,}){origin}"
                         f"{' [superseded by a later resume]' if condition.superseded else ''}")
            lines += [f"    {line}" for line in facts.describe()] + [f"    FLAG: {f}" for f in condition.flags()]
    return lines + [f"FLAG: {flag}" for flag in comparison.cross_run_flags]


def resume_check_lines(check: ResumeCheck) -> list[str]:
    verdict = "unverified" if check.verdict is None else check.verdict.value
    details = [f"  {b.message}" for b in check.boundaries] or ["  no effective resume boundary in the resumed run"]
    return [f"resume check: {check.resumed} against reference {check.reference}: {verdict}", *details]


def eval_lines(comparison: Comparison) -> list[str]:
    """Each run's best evaluations, where any run evaluated."""
    if not any(evals.count for evals in comparison.evals.values()):
        return []
    return [f"{label}: {line}" for label, evals in comparison.evals.items() for line in evals.describe()]


def format_text(comparison: Comparison, check: ResumeCheck | None) -> str:
    rows = [("quantity", *(run.label for run in comparison.runs)),
            *((name, *cells) for name, cells in comparison.table)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    out.insert(1, "-+-".join("-" * width for width in widths))
    out += [THROUGHPUT_NOTE, "", *comparability_lines(comparison), "", *held_fixed_lines(comparison),
            *(f"  {d}" for d in comparison.differences)]
    if evals := eval_lines(comparison):
        out += ["", "best evaluations:", *(f"  {line}" for line in evals)]
    out += ["", "resume conditions:", *condition_lines(comparison)]
    return "\n".join(out + (["", *resume_check_lines(check)] if check is not None else [])) + "\n"


def format_markdown(comparison: Comparison, check: ResumeCheck | None, plot_name: str | None) -> str:
    labels = [run.label for run in comparison.runs]

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    verdict, *reasons = comparability_lines(comparison)
    out = ["# Run comparison", "", f"Runs: {', '.join(f'`{label}`' for label in labels)}", "",
           f"**{verdict}**", "", *(f"- {reason.strip()}" for reason in reasons), *([""] if reasons else []),
           "## Batch arithmetic and learning curves", "",
           # An HTML table puts the arithmetic beside the plot; the blank lines let Markdown render inside it.
           '<table><tr><td valign="top">', "", row(["quantity", *labels]), "|---|" + "---|" * len(labels),
           *(row([name, *cells]) for name, cells in comparison.table), "", "</td><td>", ""]
    if plot_name is not None:
        out.append(f"![learning curves against loop steps, sample presentations and optimizer updates]({plot_name})")
    out += ["", "</td></tr></table>", "", "`~` marks a count derived from the batch arithmetic (no interval ended "
            f"at that step); {THROUGHPUT_NOTE}.", "", "## What was held fixed", ""]
    out += [f"- {text}" for text in [*held_fixed_lines(comparison), *comparison.differences]]
    if evals := eval_lines(comparison):
        out += ["", "## Best evaluations", "", *(f"- {line}" for line in evals)]
    out += ["", "## Resume conditions", "", "```", *condition_lines(comparison), "```", ""]
    if check is not None:
        headline, *details = resume_check_lines(check)
        out += ["## Sample order at resume", "", f"**{headline}**", "", *(f"- {d.strip()}" for d in details), ""]
    return "\n".join(out)


def plot_learning_curves(records: Sequence[RunRecord], path: Path) -> Path:
    """A PNG of each run's loss against loop steps, sample presentations and optimizer updates, with a row for the
    success rate and one for the validation loss where a run evaluated; dotted lines mark resumes. Draws on the Agg
    canvas directly, so no global matplotlib backend is touched."""
    rows = [("loss (mean over ranks)", None)] + [
        (title, metric) for title, metric in (("success rate", "success_rate"), ("validation loss", "val_loss"))
        if any(getattr(e.metrics, metric) is not None for record in records for e in record.evals)]
    figure = Figure(figsize=(16, 1.2 + 4 * len(rows)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(len(rows), len(_CURVE_AXES), squeeze=False)
    for record, label in zip(records, run_labels(records)):
        shapes = dict.fromkeys(f"{a.batch_size}x{a.dp_world_size}x{a.grad_accum_steps} = {a.effective_batch_size}"
                               for a in (segment.start.facts.batch for segment in record.effective_segments))
        legend = f"{label}: microbatch x workers x accumulation = effective batch: {' -> '.join(shapes)}"
        for axes, (_, metric) in zip(grid, rows):
            points = ([(interval.progress, interval.metrics["loss"]) for interval in record.intervals] if metric is None
                      else [(e.progress, getattr(e.metrics, metric)) for e in record.evals
                            if getattr(e.metrics, metric) is not None])
            for ax, (attribute, _) in zip(axes, _CURVE_AXES):
                line = ax.plot([getattr(p, attribute) for p, _ in points], [value for _, value in points],
                               marker=".", label=legend)
                for segment in record.effective_segments[1:]:
                    ax.axvline(getattr(segment.start.progress, attribute), color=line[0].get_color(), linestyle=":")
    for axes, (ylabel, _) in zip(grid, rows):
        for ax, (_, title) in zip(axes, _CURVE_AXES):
            ax.set(xlabel=title, ylabel=ylabel, title=f"{ylabel.split(' (')[0]} vs {title}")
            ax.grid(alpha=0.3)
    figure.legend(*grid[0][0].get_legend_handles_labels(), loc="outside lower center", fontsize="small")
    figure.suptitle("Same runs, three x axes (dotted lines: resumes)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def to_json(comparison: Comparison, check: ResumeCheck | None, **paths: Path) -> str:
    """One JSON object for machines: the comparison, the resume check and ``paths``; NaN/inf (a diverged loss)
    become null instead of invalid JSON tokens."""

    def finite(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [finite(item) for item in value]
        return None if isinstance(value, float) and not math.isfinite(value) else value

    payload = {"comparison": asdict(comparison), "resume_check": check and asdict(check), **paths}
    return json.dumps(finite(payload), indent=2, allow_nan=False, default=str)

