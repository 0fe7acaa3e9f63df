"""Run comparison from synthetic ledgers: arithmetic table, held-fixed quantities, resume checks, CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lerobot_mg.accounting.compare import (
    DIVERGED,
    SAMPLE_EXACT,
    UNVERIFIED,
    check_resume,
    compare_runs,
    pick_resumed_run,
)
from lerobot_mg.accounting.ledger import BatchArithmetic, RunLedger, read_ledger, sample_digest
from lerobot_mg.accounting.report import format_markdown, format_text, main

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 1000
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def update_indices(update: int, effective_batch_size: int, seed: int) -> list[int]:
    """The global sample indices of one optimizer update in a seeded shuffled stream."""
    order = np.random.default_rng(seed).permutation(NUM_SAMPLES)
    first = (update - 1) * effective_batch_size
    return [int(order[(first + i) % NUM_SAMPLES]) for i in range(effective_batch_size)]


def simulate_run(
    run_dir: Path,
    arithmetic: BatchArithmetic,
    *,
    num_loop_steps: int,
    log_every: int,
    start_step: int = 0,
    seconds_per_step: float = 1.0,
    seed: int = 0,
    diverge_from_update: int | None = None,
    world_size: int | None = None,
    topology: dict | None = None,
    commit: str = "c" * 40,
    dataset: str = "embedded:abc",
) -> None:
    """Append one attempt (a start, or a resume when start_step > 0) to run_dir's ledger, as training would.

    Updates fall on loop steps that are multiples of the accumulation; loss falls with sample presentations,
    so curves differ by axis. `diverge_from_update` reshuffles the stream from that update on.
    """
    samples_seen = arithmetic.sample_presentations(start_step)
    updates = arithmetic.optimizer_updates(start_step)
    with RunLedger(run_dir, is_main=True) as ledger:
        ledger.record_start(
            kind="resume" if start_step else "start",
            loop_step=start_step,
            samples_seen=samples_seen,
            optimizer_updates=updates,
            arithmetic=arithmetic,
            topology=topology or {"dp_replicate": 1, "dp_shard": arithmetic.dp_world_size},
            world_size=world_size or arithmetic.dp_world_size,
            precision="fp32",
            code_revision={"commit": commit, "dirty": False},
            dataset_fingerprint=dataset,
            checkpoint_format="safetensors",
            resumed_from=f"checkpoints/{start_step:06d}" if start_step else None,
            lr_schedule={"type": "cosine", "lr": 1e-4, "warmup_steps": 2, "total_steps": 100},
            sampler_continuation="sample-exact" if start_step else None,
        )
        for step in range(start_step + 1, num_loop_steps + 1):
            samples_seen += arithmetic.samples_per_loop_step
            if step % arithmetic.grad_accum_steps == 0:
                updates += 1
                stream_seed = seed + 1 if diverge_from_update and updates >= diverge_from_update else seed
                indices = update_indices(updates, arithmetic.effective_batch_size, stream_seed)
                ledger.record_update(
                    optimizer_update=updates,
                    loop_step=step,
                    digest=sample_digest(indices),
                    num_samples=len(indices),
                )
            if step % log_every == 0:
                ledger.record_interval(
                    loop_step=step,
                    samples_seen=samples_seen,
                    optimizer_updates=updates,
                    effective_batch_size=arithmetic.effective_batch_size,
                    lr=1e-4,
                    loss=10.0 / (1.0 + samples_seen),
                    wall_time_s=seconds_per_step * (step - start_step),
                )


CONFIG_A = BatchArithmetic(batch_size=8, dp_world_size=1, grad_accum_steps=1)
CONFIG_B = BatchArithmetic(batch_size=2, dp_world_size=2, grad_accum_steps=2)


@pytest.fixture
def note_runs(tmp_path: Path) -> tuple[Path, Path]:
    """The note's two configurations scaled down: 8x1x1 vs 2x2x2 over the same 40 loop steps."""
    simulate_run(tmp_path / "run_a", CONFIG_A, num_loop_steps=40, log_every=10)
    simulate_run(tmp_path / "run_b", CONFIG_B, num_loop_steps=40, log_every=10)
    return tmp_path / "run_a", tmp_path / "run_b"


def test_equal_loop_steps_show_the_hidden_arithmetic(note_runs: tuple[Path, Path]) -> None:
    comparison = compare_runs([read_ledger(run_dir) for run_dir in note_runs])
    run_a, run_b = comparison.runs
    assert comparison.shared_loop_step == 40
    for run, arithmetic in ((run_a, CONFIG_A), (run_b, CONFIG_B)):
        assert run.arithmetic == (arithmetic,)
        assert run.total.samples_seen == arithmetic.sample_presentations(40)
        assert run.total.optimizer_updates == arithmetic.optimizer_updates(40)
        assert run.shared == run.total
    assert (run_a.total.samples_seen, run_a.total.optimizer_updates) == (320, 40)
    assert (run_b.total.samples_seen, run_b.total.optimizer_updates) == (160, 20)
    # Same effective batch (8) and loop steps, yet half the data exposure and half the updates; two workers
    # for the same wall time double the compute budget.
    assert comparison.held_fixed == {
        "data exposure": False,
        "update count": False,
        "effective batch": True,
        "compute budget": False,
    }
    assert comparison.same_lr_schedule and not comparison.same_accumulation
    assert "sample presentations (data exposure) differs: run_a 320, run_b 160" in comparison.differences
    assert "optimizer updates (update count) differs: run_a 40, run_b 20" in comparison.differences
    assert "accumulation steps differs: run_a 1, run_b 2" in comparison.differences
    assert not any(d.startswith("loop steps") for d in comparison.differences)

    text = format_text(comparison, None)
    assert "held fixed: effective batch\n" in text
    assert "not held fixed: data exposure, update count, compute budget" in text
    assert "batch_size 2 x dp_world_size 2 x grad_accum 2 = effective batch 8" in text


def test_runs_that_hold_everything_fixed(tmp_path: Path) -> None:
    # 8x1x1 on one worker vs 4x2x1 on two workers taking half the time per step.
    simulate_run(tmp_path / "one", CONFIG_A, num_loop_steps=20, log_every=5, seconds_per_step=1.0)
    config = BatchArithmetic(batch_size=4, dp_world_size=2, grad_accum_steps=1)
    simulate_run(tmp_path / "two", config, num_loop_steps=20, log_every=5, seconds_per_step=0.5)
    comparison = compare_runs([read_ledger(tmp_path / "one"), read_ledger(tmp_path / "two")])
    assert all(comparison.held_fixed.values())
    assert [run.compute_budget_worker_s for run in comparison.runs] == [20.0, 20.0]
    assert "held fixed: data exposure, update count, effective batch, compute budget" in format_text(
        comparison, None
    )


def test_counts_at_an_unlogged_shared_step_are_derived_and_marked(tmp_path: Path) -> None:
    simulate_run(tmp_path / "short", CONFIG_A, num_loop_steps=40, log_every=10)
    simulate_run(tmp_path / "long", CONFIG_B, num_loop_steps=80, log_every=15)
    comparison = compare_runs([read_ledger(tmp_path / "short"), read_ledger(tmp_path / "long")])
    assert comparison.shared_loop_step == 40
    long_run = comparison.runs[1]
    assert not long_run.shared.exact
    assert long_run.shared.samples_seen == CONFIG_B.sample_presentations(40) == 160
    assert long_run.shared.optimizer_updates == CONFIG_B.optimizer_updates(40) == 20
    assert long_run.total.loop_step == 75
    text = format_text(comparison, None)
    assert "sample presentations @ loop step 40" in text and "~160" in text


def test_resume_conditions_flag_what_changed(tmp_path: Path) -> None:
    run_dir = tmp_path / "resumed"
    simulate_run(run_dir, CONFIG_B, num_loop_steps=30, log_every=10)
    changed = BatchArithmetic(batch_size=4, dp_world_size=1, grad_accum_steps=2)
    simulate_run(
        run_dir,
        changed,
        num_loop_steps=40,
        log_every=10,
        start_step=20,
        commit="d" * 40,
        dataset="embedded:xyz",
    )
    simulate_run(tmp_path / "reference", CONFIG_B, num_loop_steps=40, log_every=10)
    comparison = compare_runs([read_ledger(run_dir), read_ledger(tmp_path / "reference")])
    start, resume = comparison.conditions["resumed"]
    assert start.flags == ()
    assert resume.flags == (
        "steps 21-30 re-run at resume (step 20): the previous attempt reached step 30; its records past the "
        "resume step are superseded",
        'topology changed at resume (step 20): {"dp_replicate": 1, "dp_shard": 2} -> '
        '{"dp_replicate": 1, "dp_shard": 1}',
        "world size changed at resume (step 20): 2 -> 1",
        "batch changed at resume (step 20): batch_size 2 x dp_world_size 2 x grad_accum 2 = effective batch 8"
        " -> batch_size 4 x dp_world_size 1 x grad_accum 2 = effective batch 8",
        f"code revision changed at resume (step 20): {'c' * 12} -> {'d' * 12}",
        "dataset changed at resume (step 20): embedded:abc -> embedded:xyz",
    )
    resumed_run = comparison.runs[0]
    assert resumed_run.arithmetic == (CONFIG_B, changed)
    assert resumed_run.total.samples_seen == CONFIG_B.sample_presentations(20) + changed.sample_presentations(
        20
    )
    # The factorisation changed mid-run but the effective batch stayed 8, so that was still held fixed.
    assert comparison.held_fixed["effective batch"] is True
    assert "microbatch per worker differs: resumed 2 -> 4, reference 2" in comparison.differences
    text = format_text(comparison, None)
    assert "FLAG: world size changed at resume (step 20): 2 -> 1" in text
    assert re.search(r"\nmicrobatch per worker +\| 2 -> 4 +\| 2\n", text)
    assert re.search(r"\neffective batch +\| 8 +\| 8\n", text)


def _resumed_pair(tmp_path: Path, diverge_from_update: int | None) -> tuple[Path, Path]:
    """A 2x2x2 run that crashed at step 30 and resumed from step 20 (update 10), and its reference."""
    simulate_run(tmp_path / "reference", CONFIG_B, num_loop_steps=40, log_every=10)
    resumed = tmp_path / "resumed"
    simulate_run(resumed, CONFIG_B, num_loop_steps=30, log_every=10)
    simulate_run(
        resumed,
        CONFIG_B,
        num_loop_steps=40,
        log_every=10,
        start_step=20,
        diverge_from_update=diverge_from_update,
    )
    return resumed, tmp_path / "reference"


def test_check_resume_confirms_a_sample_exact_stream(tmp_path: Path) -> None:
    resumed, reference = _resumed_pair(tmp_path, diverge_from_update=None)
    picked = pick_resumed_run([read_ledger(reference), read_ledger(resumed)])
    assert picked[0].run_dir == resumed
    check = check_resume(*picked)
    assert check.verdict == SAMPLE_EXACT and check.sample_exact
    (boundary,) = check.boundaries
    assert (boundary.loop_step, boundary.optimizer_update) == (20, 10)
    assert (boundary.num_compared_before, boundary.num_compared_after) == (10, 10)
    assert boundary.message == (
        "sample-exact around the resume at loop step 20 (after optimizer update 10, from checkpoints/000020): "
        "10 update(s) before and 10 after match the reference"
    )


def test_check_resume_names_the_first_diverging_update(tmp_path: Path) -> None:
    resumed, reference = _resumed_pair(tmp_path, diverge_from_update=12)
    check = check_resume(read_ledger(resumed), read_ledger(reference))
    assert check.verdict == DIVERGED
    (boundary,) = check.boundaries
    divergence = boundary.first_divergence
    assert divergence is not None
    assert (divergence.optimizer_update, divergence.loop_step) == (12, 24)
    assert divergence.reference_digest == sample_digest(update_indices(12, 8, seed=0))
    assert boundary.message.startswith(
        "diverges at optimizer update 12 (loop step 24), 2 update(s) after the resume at loop step 20"
    )
    # A window of one update either side stops short of the divergence.
    assert check_resume(read_ledger(resumed), read_ledger(reference), window=1).verdict == SAMPLE_EXACT


def test_check_resume_without_digests_after_the_boundary_is_unverified(tmp_path: Path) -> None:
    simulate_run(tmp_path / "reference", CONFIG_B, num_loop_steps=20, log_every=10)
    simulate_run(tmp_path / "resumed", CONFIG_B, num_loop_steps=20, log_every=10)
    simulate_run(tmp_path / "resumed", CONFIG_B, num_loop_steps=40, log_every=10, start_step=20)
    check = check_resume(read_ledger(tmp_path / "resumed"), read_ledger(tmp_path / "reference"))
    assert check.verdict == UNVERIFIED
    assert "no sample digests to compare after the resume at loop step 20" in check.boundaries[0].message


def test_check_resume_needs_a_resumed_run(note_runs: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="neither .* has a resume record"):
        pick_resumed_run([read_ledger(run_dir) for run_dir in note_runs])


def test_markdown_holds_the_table_and_the_plot(note_runs: tuple[Path, Path], tmp_path: Path) -> None:
    out_dir = tmp_path / "report"
    assert main([*map(str, note_runs), "--out", str(out_dir)]) == 0
    markdown = (out_dir / "report.md").read_text()
    assert "| quantity | run_a | run_b |" in markdown
    assert "| sample presentations (total) | 320 | 160 |" in markdown
    assert "| optimizer updates (total) | 40 | 20 |" in markdown
    assert "](learning_curves.png)" in markdown
    assert "- held fixed: effective batch" in markdown
    png = (out_dir / "learning_curves.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert format_markdown(compare_runs([read_ledger(d) for d in note_runs]), None, None).count("![") == 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "compare_runs.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_cli_json_and_text(note_runs: tuple[Path, Path], tmp_path: Path) -> None:
    out_dir = tmp_path / "cli"
    completed = _cli(*map(str, note_runs), "--json", "--out", str(out_dir))
    assert completed.returncode == 0, completed.stderr
    payload = json.loads(completed.stdout)
    runs = payload["comparison"]["runs"]
    assert [(r["total"]["samples_seen"], r["total"]["optimizer_updates"]) for r in runs] == [
        (320, 40),
        (160, 20),
    ]
    assert payload["comparison"]["held_fixed"]["effective batch"] is True
    assert payload["resume_check"] is None
    assert Path(payload["plot"]).stat().st_size > 0 and Path(payload["report"]).is_file()

    completed = _cli(*map(str, note_runs), "--out", str(out_dir))
    assert completed.returncode == 0, completed.stderr
    assert "sample presentations (total)" in completed.stdout and "not held fixed:" in completed.stdout


def test_cli_check_resume_exit_status(tmp_path: Path) -> None:
    resumed, reference = _resumed_pair(tmp_path / "exact", diverge_from_update=None)
    completed = _cli(str(resumed), str(reference), "--check-resume", "--out", str(tmp_path / "o1"))
    assert completed.returncode == 0, completed.stderr
    assert "resume check: resumed against reference reference: sample-exact" in completed.stdout

    resumed, reference = _resumed_pair(tmp_path / "diverged", diverge_from_update=11)
    completed = _cli(str(reference), str(resumed), "--check-resume", "--json", "--out", str(tmp_path / "o2"))
    assert completed.returncode == 1
    check = json.loads(completed.stdout)["resume_check"]
    assert check["verdict"] == "diverged"
    assert check["boundaries"][0]["first_divergence"]["optimizer_update"] == 11


def test_cli_user_errors(tmp_path: Path) -> None:
    completed = _cli(str(tmp_path), str(tmp_path))
    assert completed.returncode == 2
    assert f"lerobot-mg-compare: error: {tmp_path} has no ledger.jsonl" in completed.stderr
