"""Render a run comparison: console table, Markdown report, learning-curve PNG, JSON; and the CLI.

The learning curves are drawn three times over the same runs, against loop steps, sample presentations
and optimizer updates, because a curve that leads on one axis can trail on another
(seeds/comparing-runs.md). The Markdown puts the arithmetic table beside the plot for the same reason.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lerobot_mg.accounting.compare import (
    HELD_FIXED_QUANTITIES,
    SAMPLE_EXACT,
    Comparison,
    ResumeCheck,
    RunSummary,
    check_resume,
    compare_runs,
    format_revision,
    format_schedule,
    pick_resumed_run,
    run_labels,
)
from lerobot_mg.accounting.ledger import RunRecord, read_ledger

PLOT_FILENAME = "learning_curves.png"
REPORT_FILENAME = "report.md"
_CURVE_AXES = (
    ("loop_step", "loop steps"),
    ("samples_seen", "sample presentations"),
    ("optimizer_updates", "optimizer updates"),
)


def _number(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}"


def _counts_cell(value: int, exact: bool) -> str:
    # "~" marks a count derived from the batch arithmetic because no interval was logged at that step.
    return f"{value:,}" if exact else f"~{value:,}"


def _arith(run: RunSummary, field: str) -> str:
    values = [getattr(a, field) for a in run.arithmetic]
    distinct = [value for i, value in enumerate(values) if i == 0 or values[i - 1] != value]
    return " -> ".join(f"{value:,}" for value in distinct)


def table_rows(comparison: Comparison) -> list[tuple[str, list[str]]]:
    """The arithmetic table: one row per quantity, one column per run."""
    runs = comparison.runs
    step = comparison.shared_loop_step
    return [
        ("microbatch per worker", [_arith(r, "batch_size") for r in runs]),
        ("data-parallel workers", [_arith(r, "dp_world_size") for r in runs]),
        ("accumulation steps", [_arith(r, "grad_accum_steps") for r in runs]),
        ("effective batch", [_arith(r, "effective_batch_size") for r in runs]),
        ("world size", [" -> ".join(str(w) for w in r.world_sizes) for r in runs]),
        ("precision", [" -> ".join(r.precisions) for r in runs]),
        (
            f"sample presentations @ loop step {step:,}",
            [_counts_cell(r.shared.samples_seen, r.shared.exact) for r in runs],
        ),
        (
            f"optimizer updates @ loop step {step:,}",
            [_counts_cell(r.shared.optimizer_updates, r.shared.exact) for r in runs],
        ),
        ("loop steps (total)", [f"{r.total.loop_step:,}" for r in runs]),
        ("sample presentations (total)", [f"{r.total.samples_seen:,}" for r in runs]),
        ("optimizer updates (total)", [f"{r.total.optimizer_updates:,}" for r in runs]),
        ("lr schedule", [" -> ".join(format_schedule(s) for s in r.lr_schedules) for r in runs]),
        ("final lr", [_number(r.final_lr) for r in runs]),
        ("final loss", [_number(r.final_loss) for r in runs]),
        ("wall time (s)", [f"{r.wall_time_s:.1f}" for r in runs]),
        ("compute budget (worker-s)", [f"{r.compute_budget_worker_s:.1f}" for r in runs]),
    ]


def held_fixed_lines(comparison: Comparison) -> list[str]:
    held = [name for name in HELD_FIXED_QUANTITIES if comparison.held_fixed[name]]
    varied = [name for name in HELD_FIXED_QUANTITIES if not comparison.held_fixed[name]]
    return [
        f"held fixed: {', '.join(held) if held else 'none of ' + ', '.join(HELD_FIXED_QUANTITIES)}",
        f"not held fixed: {', '.join(varied) if varied else 'none'}",
        f"same lr schedule: {'yes' if comparison.same_lr_schedule else 'no'}; "
        f"same accumulation boundary: {'yes' if comparison.same_accumulation else 'no'}",
    ]


def condition_lines(comparison: Comparison) -> list[str]:
    lines: list[str] = []
    for label, segments in comparison.conditions.items():
        lines.append(f"{label}:")
        for segment in segments:
            origin = f" from {segment.resumed_from}" if segment.resumed_from else ""
            superseded = " [superseded by a later resume]" if segment.superseded else ""
            lines.append(
                f"  {segment.kind} at loop step {segment.loop_step:,} (update {segment.optimizer_updates:,})"
                f"{origin}{superseded}"
            )
            lines.append(
                f"    code {format_revision(segment.code_revision)}; world size {segment.world_size}; "
                f"topology {json.dumps(segment.topology, sort_keys=True)}"
            )
            lines.append(f"    {segment.arithmetic.banner()}; precision {segment.precision}")
            lines.append(
                f"    dataset {segment.dataset_fingerprint}; checkpoint format {segment.checkpoint_format}; "
                f"sampler continuation {segment.sampler_continuation or '-'}"
            )
            lines += [f"    FLAG: {flag}" for flag in segment.flags]
    lines += [f"FLAG: {flag}" for flag in comparison.cross_run_flags]
    return lines


def resume_check_lines(check: ResumeCheck) -> list[str]:
    lines = [f"resume check: {check.resumed} against reference {check.reference}: {check.verdict}"]
    if not check.boundaries:
        lines.append("  no effective resume boundary in the resumed run")
    lines += [f"  {boundary.message}" for boundary in check.boundaries]
    return lines


def format_text(comparison: Comparison, check: ResumeCheck | None) -> str:
    header = ["quantity"] + [run.label for run in comparison.runs]
    rows = [[name, *cells] for name, cells in table_rows(comparison)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    out = [line(header), "-+-".join("-" * width for width in widths)]
    out += [line(row) for row in rows]
    out += ["", *held_fixed_lines(comparison)]
    out += [f"  {difference}" for difference in comparison.differences]
    out += ["", "resume conditions:", *condition_lines(comparison)]
    if check is not None:
        out += ["", *resume_check_lines(check)]
    return "\n".join(out) + "\n"


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|")


def format_markdown(comparison: Comparison, check: ResumeCheck | None, plot_name: str | None) -> str:
    labels = [run.label for run in comparison.runs]
    out = ["# Run comparison", "", f"Runs: {', '.join(f'`{label}`' for label in labels)}", ""]
    out += ["## Batch arithmetic and learning curves", ""]
    # An HTML table puts the arithmetic beside the plot; the blank lines let Markdown render inside it.
    out += ['<table><tr><td valign="top">', ""]
    out.append("| quantity | " + " | ".join(_markdown_cell(label) for label in labels) + " |")
    out.append("|---|" + "---|" * len(labels))
    for name, cells in table_rows(comparison):
        out.append(f"| {_markdown_cell(name)} | " + " | ".join(_markdown_cell(cell) for cell in cells) + " |")
    out += ["", "</td><td>", ""]
    if plot_name is not None:
        out.append(
            f"![learning curves against loop steps, sample presentations and optimizer updates]({plot_name})"
        )
    out += ["", "</td></tr></table>", ""]
    out += ["`~` marks a count derived from the batch arithmetic (no interval logged at that step).", ""]
    out += ["## What was held fixed", ""]
    out += [f"- {text}" for text in held_fixed_lines(comparison)]
    out += [f"- {difference}" for difference in comparison.differences]
    out += ["", "## Resume conditions", "", "```", *condition_lines(comparison), "```", ""]
    if check is not None:
        headline, *details = resume_check_lines(check)
        out += [
            "## Sample order at resume",
            "",
            f"**{headline}**",
            "",
            *[f"- {d.strip()}" for d in details],
            "",
        ]
    return "\n".join(out)


def _compact_arithmetic(record: RunRecord) -> str:
    shapes = [
        f"{a.batch_size}x{a.dp_world_size}x{a.grad_accum_steps} = {a.effective_batch_size}"
        for a in (segment.start.arithmetic for segment in record.effective_segments)
    ]
    return " -> ".join(dict.fromkeys(shapes))


def plot_learning_curves(records: Sequence[RunRecord], path: Path) -> Path:
    """Write a PNG with the loss of each run against loop steps, sample presentations, optimizer updates.

    Dotted vertical lines mark where a run resumed. Uses the Agg canvas directly, so no global matplotlib
    backend is touched.
    """
    figure = Figure(figsize=(16, 5.2), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(_CURVE_AXES))
    for record, label in zip(records, run_labels(records)):
        intervals = record.intervals
        legend = (
            f"{label}: microbatch x workers x accumulation = effective batch: {_compact_arithmetic(record)}"
        )
        for ax, (attribute, _) in zip(axes, _CURVE_AXES):
            xs = [getattr(interval, attribute) for interval in intervals]
            line = ax.plot(xs, [interval.loss for interval in intervals], marker=".", label=legend)
            for segment in record.effective_segments[1:]:
                ax.axvline(
                    getattr(segment.start, attribute), color=line[0].get_color(), linestyle=":", alpha=0.8
                )
    for ax, (_, title) in zip(axes, _CURVE_AXES):
        ax.set_xlabel(title)
        ax.set_ylabel("loss (mean over ranks)")
        ax.set_title(f"loss vs {title}")
        ax.grid(alpha=0.3)
    handles, legend_labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, legend_labels, loc="outside lower center", fontsize="small")
    figure.suptitle("Same runs, three x axes (dotted lines: resumes)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def _finite(value: Any) -> Any:
    """JSON for machines: NaN/inf (a diverged loss) become null instead of invalid JSON tokens."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def default_out_dir(records: Sequence[RunRecord]) -> Path:
    name = "__vs__".join(run_labels(records))
    return Path("outputs") / "compare" / re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:150]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lerobot-mg-compare",
        description=(
            "Compare training runs by their ledgers: sample presentations, optimizer updates, effective batch, "
            "what was held fixed, and the conditions of every resume."
        ),
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories (>= 2)")
    parser.add_argument(
        "--check-resume",
        action="store_true",
        help="with two runs, one resumed: compare per-update sample digests around the resume boundary "
        "(exit status 1 unless sample-exact)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help="with --check-resume: compare only this many optimizer updates on each side of the boundary",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for the PNG and Markdown report (default: outputs/compare/<run names>)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the text report"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`lerobot-mg-compare RUN_DIR RUN_DIR ...`; returns the exit status (2 on a user error)."""
    args = build_parser().parse_args(argv)
    try:
        records = [read_ledger(run_dir) for run_dir in args.run_dirs]
        comparison = compare_runs(records)
        check = None
        if args.check_resume:
            resumed, reference = pick_resumed_run(records)
            check = check_resume(resumed, reference, window=args.window)
        elif args.window is not None:
            raise ValueError(
                "--window only applies with --check-resume; add --check-resume or drop --window."
            )
    except ValueError as error:
        print(f"lerobot-mg-compare: error: {error}", file=sys.stderr)
        return 2
    out_dir = args.out if args.out is not None else default_out_dir(records)
    plot_path = plot_learning_curves(records, out_dir / PLOT_FILENAME)
    report_path = out_dir / REPORT_FILENAME
    report_path.write_text(format_markdown(comparison, check, plot_path.name), encoding="utf-8")
    if args.json:
        payload = {
            "comparison": comparison.to_json(),
            "resume_check": None if check is None else check.to_json(),
            "plot": str(plot_path),
            "report": str(report_path),
        }
        print(json.dumps(_finite(payload), indent=2, allow_nan=False))
    else:
        sys.stdout.write(format_text(comparison, check))
        print(f"\nwrote {plot_path} and {report_path}")
    return 0 if check is None or check.verdict == SAMPLE_EXACT else 1
