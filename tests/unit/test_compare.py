"""Run comparison from synthetic ledgers: arithmetic table, held-fixed quantities, resume checks, CLI.

The ledgers are written here, wall times included, so every verdict on a figure measured by the clock (the compute
budget) is asserted on times the test chose, never on how fast this machine ran something."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lerobot_mg.accounting.compare import (
    DEFAULT_TOLERANCE,
    Held,
    Quantity,
    check_resume,
    compare_runs,
    pick_resumed_run,
)
from lerobot_mg.accounting.ledger import IntervalRecord, RunLedger, StartRecord, UpdateDigest, read_ledger
from lerobot_mg.accounting.report import format_markdown, format_text
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Continuation, Topology
from lerobot_mg.errors import ConfigError
from lerobot_mg.run_facts import CodeRevision, FactChange, Progress, ResumeCause, RunFacts
from lerobot_mg.scripts_entry import compare_runs as main

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 1000
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCHEDULE = {"type": "cosine", "lr": 1e-4, "warmup_steps": 2, "total_steps": 100}


def update_digest(update: int, effective_batch_size: int, seed: int) -> str:
    """A digest of the global sample indices of one optimizer update in a seeded shuffled stream."""
    order = np.random.default_rng(seed).permutation(NUM_SAMPLES)
    first = (update - 1) * effective_batch_size
    indices = [int(order[(first + i) % NUM_SAMPLES]) for i in range(effective_batch_size)]
    return hashlib.blake2b(repr(indices).encode(), digest_size=6).hexdigest()


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
    topology: Topology | None = None,
    commit: str = "c" * 40,
    dataset: str = "embedded:abc",
) -> None:
    """Append one attempt (a start, or a resume when start_step > 0) to run_dir's ledger, as training would.

    Updates fall on loop steps that are multiples of the accumulation; loss falls with sample presentations,
    so curves differ by axis. `diverge_from_update` reshuffles the stream from that update on.
    """
    progress = Progress(start_step, arithmetic.sample_presentations(start_step),
                        arithmetic.optimizer_updates(start_step))
    facts = RunFacts(
        batch=arithmetic, topology=topology or Topology(1, arithmetic.dp_world_size, arithmetic.dp_world_size),
        precision="fp32", checkpoint_format="safetensors", code_revision=CodeRevision(commit, False),
        dataset_fingerprint=dataset, lr_schedule=SCHEDULE, model={"total_params": 10, "trainable_params": 10},
        rank_bytes=({"parameters": 40},) * arithmetic.dp_world_size,
        resumed_from=f"checkpoints/{start_step:06d}" if start_step else None,
        # What training writes: how exactly this resume continues the stream of the attempt before it.
        continuation=Continuation.of_resume(read_ledger(run_dir).segments[-1].start.facts.batch, arithmetic)
        if start_step else None,
        resume_cause=ResumeCause.REQUESTED if start_step else None,
    )
    ledger = RunLedger(run_dir, is_main=True)
    ledger.write(StartRecord(0.0, dataclasses.replace(progress), facts))
    updates: list[UpdateDigest] = []
    for step in range(start_step + 1, num_loop_steps + 1):
        progress.step += 1
        progress.samples_seen += arithmetic.samples_per_loop_step
        if step % arithmetic.grad_accum_steps == 0:
            progress.optimizer_updates += 1
            update = progress.optimizer_updates
            stream_seed = seed + 1 if diverge_from_update and update >= diverge_from_update else seed
            updates.append(UpdateDigest(update, step, update_digest(update, arithmetic.effective_batch_size,
                                                                    stream_seed), arithmetic.effective_batch_size))
        if step % log_every == 0:
            metrics = {"loss": 10.0 / (1.0 + progress.samples_seen), "lr": 1e-4}
            ledger.write(IntervalRecord(0.0, dataclasses.replace(progress), seconds_per_step * (step - start_step),
                                        metrics, tuple(updates)))
            updates = []
    ledger.close()


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
    assert {quantity: verdict.verdict for quantity, verdict in comparison.held_fixed.items()} == {
        Quantity.DATA_EXPOSURE: Held.NOT_HELD,
        Quantity.UPDATE_COUNT: Held.NOT_HELD,
        Quantity.EFFECTIVE_BATCH: Held.HELD,
        Quantity.COMPUTE_BUDGET: Held.NOT_HELD,
    }
    assert comparison.held_fixed[Quantity.DATA_EXPOSURE].figures == ((320,), (160,))
    assert comparison.held_fixed[Quantity.DATA_EXPOSURE].tolerance is None  # a count: exact
    assert comparison.same_lr_schedule and not comparison.same_accumulation
    assert "sample presentations (total) differs: run_a 320, run_b 160" in comparison.differences
    assert "optimizer updates (total) differs: run_a 40, run_b 20" in comparison.differences
    assert "accumulation steps differs: run_a 1, run_b 2" in comparison.differences
    assert not any(d.startswith("loop steps") for d in comparison.differences)

    text = format_text(comparison, None)
    assert "held fixed: effective batch\n" in text
    assert "not held fixed: data exposure, update count, compute budget" in text
    assert ("compute budget (worker-seconds) not held fixed: run_a 40.00, run_b 80.00, 100.00 % apart, more than "
            "the tolerance of 10 % (tolerance=0.1)\n") in text
    assert "batch_size 2 x dp_world_size 2 x grad_accum 2 = effective batch 8" in text


def test_runs_that_hold_everything_fixed(tmp_path: Path) -> None:
    # 8x1x1 on one worker vs 4x2x1 on two workers taking half the time per step.
    simulate_run(tmp_path / "one", CONFIG_A, num_loop_steps=20, log_every=5, seconds_per_step=1.0)
    config = BatchArithmetic(batch_size=4, dp_world_size=2, grad_accum_steps=1)
    simulate_run(tmp_path / "two", config, num_loop_steps=20, log_every=5, seconds_per_step=0.5)
    comparison = compare_runs([read_ledger(tmp_path / "one"), read_ledger(tmp_path / "two")])
    assert all(verdict.held for verdict in comparison.held_fixed.values())
    assert [run.compute_budget_worker_s for run in comparison.runs] == [20.0, 20.0]
    assert "held fixed: data exposure, update count, effective batch, compute budget" in format_text(
        comparison, None
    )


def _budgets(tmp_path: Path, *seconds_per_step: float) -> list:
    """Runs of the same 16 loop steps (8x1x1, one worker) whose ledgers record the given seconds per step: the
    compute budget of each is 16 x its seconds per step worker-seconds, exactly (the times are binary fractions)."""
    records = []
    for i, seconds in enumerate(seconds_per_step):
        simulate_run(tmp_path / f"run_{i}", CONFIG_A, num_loop_steps=16, log_every=4, seconds_per_step=seconds)
        records.append(read_ledger(tmp_path / f"run_{i}"))
    return records


def test_a_compute_budget_at_the_tolerance_is_held_fixed_and_past_it_is_not(tmp_path: Path) -> None:
    # 20 vs 22 worker-seconds: exactly 10 % apart, the default tolerance; the counts are equal throughout.
    at, past = _budgets(tmp_path / "at", 1.25, 1.375), _budgets(tmp_path / "past", 1.25, 1.375 + 2**-10)
    verdict = compare_runs(at).held_fixed[Quantity.COMPUTE_BUDGET]
    assert (verdict.figures, verdict.tolerance, verdict.verdict) == (((20.0,), (22.0,)), 0.1, Held.HELD)
    assert verdict.spread == 0.1
    text = format_text(compare_runs(at), None)
    assert "held fixed: data exposure, update count, effective batch, compute budget\nnot held fixed: none\n" in text
    assert ("compute budget (worker-seconds) held fixed: run_0 20.00, run_1 22.00, 10.00 % apart, within the "
            "tolerance of 10 % (tolerance=0.1)\n") in text

    comparison = compare_runs(past)  # 22.015625: 0.07 % more, past the tolerance
    verdict = comparison.held_fixed[Quantity.COMPUTE_BUDGET]
    assert verdict.figures == ((20.0,), (22.015625,)) and verdict.verdict is Held.NOT_HELD
    assert [v.held for v in comparison.held_fixed.values()] == [True, True, True, False]
    text = format_text(comparison, None)
    assert "held fixed: data exposure, update count, effective batch\nnot held fixed: compute budget\n" in text
    assert ("compute budget (worker-seconds) not held fixed: run_0 20.00, run_1 22.02, 10.08 % apart, more than "
            "the tolerance of 10 % (tolerance=0.1)\n") in text
    assert "- compute budget (worker-seconds) not held fixed: run_0 20.00, run_1 22.02" in format_markdown(
        comparison, None, None)


def test_the_tolerance_is_a_parameter_and_the_order_of_the_runs_does_not_matter(tmp_path: Path) -> None:
    records = _budgets(tmp_path, 1.375, 1.25)  # 22 then 20: relative to the smaller one, 10 % apart
    assert compare_runs(records).held_fixed[Quantity.COMPUTE_BUDGET].held
    assert not compare_runs(records, tolerance=0.05).held_fixed[Quantity.COMPUTE_BUDGET].held
    assert ("more than the tolerance of 5 % (tolerance=0.05)" in
            format_text(compare_runs(records, tolerance=0.05), None))
    same = _budgets(tmp_path / "same", 1.25, 1.25)
    assert compare_runs(same, tolerance=0.0).held_fixed[Quantity.COMPUTE_BUDGET].held  # 0: only equal figures
    assert not compare_runs(records, tolerance=0.0).held_fixed[Quantity.COMPUTE_BUDGET].held
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"^tolerance=.*: must be a relative tolerance >= 0 \(0.1 is 10 %\)\. "
                                              r"Fix: tolerance=0.1$"):
            compare_runs(records, tolerance=bad)


def test_a_run_without_a_logged_interval_has_an_unknown_compute_budget(tmp_path: Path) -> None:
    simulate_run(tmp_path / "logged", CONFIG_A, num_loop_steps=8, log_every=4)
    simulate_run(tmp_path / "crashed", CONFIG_A, num_loop_steps=3, log_every=4)  # died before its first interval
    comparison = compare_runs([read_ledger(tmp_path / "logged"), read_ledger(tmp_path / "crashed")])
    verdict = comparison.held_fixed[Quantity.COMPUTE_BUDGET]
    assert verdict.verdict is Held.UNKNOWN and not verdict.held and verdict.figures == ((8.0,), (0.0,))
    assert ("compute budget (worker-seconds) unknown: logged 8.000, crashed 0.0; a run logged no interval with wall "
            "time") in format_text(comparison, None)


def test_cli_tolerance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [str(tmp_path / f"run_{i}") for i in range(2)]
    _budgets(tmp_path, 1.25, 1.375)
    assert main([*runs, "tolerance=0.05", f"--out={tmp_path / 'o1'}"]) == 0
    assert "compute budget (worker-seconds) not held fixed: run_0 20.00, run_1 22.00, 10.00 % apart, more than the " \
           "tolerance of 5 % (tolerance=0.05)" in capsys.readouterr().out
    assert main([*runs, "--tolerance=0.1", "--json", f"--out={tmp_path / 'o2'}"]) == 0
    assert json.loads(capsys.readouterr().out)["comparison"]["held_fixed"]["compute budget"]["verdict"] == "held fixed"
    assert main([*runs, "tolerance=-1", f"--out={tmp_path / 'o3'}"]) == 2
    assert "tolerance=-1.0: must be a relative tolerance >= 0" in capsys.readouterr().err


def test_counts_at_an_unlogged_shared_step_are_derived_and_marked(tmp_path: Path) -> None:
    simulate_run(tmp_path / "short", CONFIG_A, num_loop_steps=40, log_every=10)
    simulate_run(tmp_path / "long", CONFIG_B, num_loop_steps=80, log_every=15)
    comparison = compare_runs([read_ledger(tmp_path / "short"), read_ledger(tmp_path / "long")])
    assert comparison.shared_loop_step == 40
    long_run = comparison.runs[1]
    assert not long_run.shared_exact
    assert long_run.shared.samples_seen == CONFIG_B.sample_presentations(40) == 160
    assert long_run.shared.optimizer_updates == CONFIG_B.optimizer_updates(40) == 20
    assert long_run.total.step == 75
    text = format_text(comparison, None)
    assert "sample presentations @ loop step 40" in text and "~160" in text


def test_resume_conditions_flag_what_changed(tmp_path: Path) -> None:
    run_dir = tmp_path / "resumed"
    simulate_run(run_dir, CONFIG_B, num_loop_steps=30, log_every=10)
    changed = BatchArithmetic(batch_size=4, dp_world_size=1, grad_accum_steps=2)
    simulate_run(run_dir, changed, num_loop_steps=40, log_every=10, start_step=20, commit="d" * 40,
                 dataset="embedded:xyz")
    simulate_run(tmp_path / "reference", CONFIG_B, num_loop_steps=40, log_every=10)
    comparison = compare_runs([read_ledger(run_dir), read_ledger(tmp_path / "reference")])
    start, resume = comparison.conditions["resumed"]
    assert start.flags() == [] and start.changes == ()
    # Typed: the facts that changed, with their values before and after.
    assert [change.name for change in resume.changes] == ["batch", "topology", "code_revision", "dataset_fingerprint"]
    assert resume.changes[0] == FactChange("batch", CONFIG_B, changed)
    assert resume.start.facts.continuation is Continuation.GLOBAL_BATCH_EXACT  # 2 x 2 -> 4 x 1, accumulation 2
    assert resume.flags() == [
        "steps 21-30 re-run at resume (step 20): the previous attempt reached step 30; its records past the "
        "resume step are superseded",
        "batch changed at resume (step 20): batch_size 2 x dp_world_size 2 x grad_accum 2 = effective batch 8"
        " -> batch_size 4 x dp_world_size 1 x grad_accum 2 = effective batch 8",
        "topology changed at resume (step 20): FSDP2: 2 shards -> single process",
        f"code revision changed at resume (step 20): {'c' * 12} -> {'d' * 12}",
        "dataset fingerprint changed at resume (step 20): embedded:abc -> embedded:xyz",
    ]
    resumed_run = comparison.runs[0]
    assert resumed_run.arithmetic == (CONFIG_B, changed)
    assert resumed_run.world_sizes == (2, 1)
    assert resumed_run.total.samples_seen == CONFIG_B.sample_presentations(20) + changed.sample_presentations(20)
    # The factorisation changed mid-run but the effective batch stayed 8, so that was still held fixed.
    assert comparison.held_fixed[Quantity.EFFECTIVE_BATCH].verdict is Held.HELD
    assert comparison.held_fixed[Quantity.EFFECTIVE_BATCH].figures == ((8,), (8,))
    assert "microbatch per worker differs: resumed 2 -> 4, reference 2" in comparison.differences
    text = format_text(comparison, None)
    assert "FLAG: topology changed at resume (step 20): FSDP2: 2 shards -> single process" in text
    assert "resume at loop step 20 (update 10) from checkpoints/000020 (requested): global-batch-exact\n" in text
    assert re.search(r"\nmicrobatch per worker +\| 2 -> 4 +\| 2\n", text)
    assert re.search(r"\nworld size +\| 2 -> 1 +\| 2\n", text)
    assert re.search(r"\neffective batch +\| 8 +\| 8\n", text)


def _resumed_pair(tmp_path: Path, diverge_from_update: int | None,
                  resumed_as: BatchArithmetic = CONFIG_B) -> tuple[Path, Path]:
    """A 2x2x2 run that crashed at step 30 and resumed (as ``resumed_as``) from step 20 (update 10), and its
    reference."""
    simulate_run(tmp_path / "reference", CONFIG_B, num_loop_steps=40, log_every=10)
    resumed = tmp_path / "resumed"
    simulate_run(resumed, CONFIG_B, num_loop_steps=30, log_every=10)
    simulate_run(resumed, resumed_as, num_loop_steps=40, log_every=10, start_step=20,
                 diverge_from_update=diverge_from_update)
    return resumed, tmp_path / "reference"


def test_check_resume_confirms_a_sample_exact_stream(tmp_path: Path) -> None:
    resumed, reference = _resumed_pair(tmp_path, diverge_from_update=None)
    picked = pick_resumed_run([read_ledger(reference), read_ledger(resumed)])
    assert picked[0].run_dir == resumed
    check = check_resume(*picked)
    assert check.verdict is Continuation.SAMPLE_EXACT and check.passed
    (boundary,) = check.boundaries
    assert (boundary.loop_step, boundary.optimizer_update) == (20, 10)
    assert (boundary.num_compared_before, boundary.num_compared_after) == (10, 10)
    assert boundary.message == (
        "sample-exact around the resume at loop step 20 (after optimizer update 10, from checkpoints/000020): "
        "10 update(s) before and 10 after match the reference"
    )


def test_check_resume_on_another_split_of_the_same_global_batch_is_global_batch_exact(tmp_path: Path) -> None:
    # 2 x 2 ranks -> 4 x 1 rank: every update sees the same samples, each rank others than before.
    resumed, reference = _resumed_pair(tmp_path, None, resumed_as=BatchArithmetic(4, 1, 2))
    check = check_resume(read_ledger(resumed), read_ledger(reference))
    assert check.verdict is Continuation.GLOBAL_BATCH_EXACT and check.passed
    assert check.boundaries[0].message.startswith("global-batch-exact around the resume at loop step 20")
    assert "match the reference; batch changed at resume (step 20): batch_size 2 x" in check.boundaries[0].message


def test_check_resume_names_the_first_diverging_update(tmp_path: Path) -> None:
    resumed, reference = _resumed_pair(tmp_path, diverge_from_update=12)
    check = check_resume(read_ledger(resumed), read_ledger(reference))
    assert check.verdict is Continuation.NOT_EXACT and not check.passed
    (boundary,) = check.boundaries
    assert boundary.first_divergence is not None
    mine, theirs = boundary.first_divergence
    assert (mine.optimizer_update, mine.loop_step, theirs.optimizer_update) == (12, 24, 12)
    assert theirs.digest == update_digest(12, 8, seed=0) != mine.digest
    assert boundary.message.startswith(
        "diverges at optimizer update 12 (loop step 24), 2 update(s) after the resume at loop step 20"
    )
    # A window of one update either side stops short of the divergence.
    assert check_resume(read_ledger(resumed), read_ledger(reference), window=1).verdict is Continuation.SAMPLE_EXACT


def test_check_resume_without_digests_after_the_boundary_is_unverified(tmp_path: Path) -> None:
    simulate_run(tmp_path / "reference", CONFIG_B, num_loop_steps=20, log_every=10)
    simulate_run(tmp_path / "resumed", CONFIG_B, num_loop_steps=20, log_every=10)
    simulate_run(tmp_path / "resumed", CONFIG_B, num_loop_steps=40, log_every=10, start_step=20)
    check = check_resume(read_ledger(tmp_path / "resumed"), read_ledger(tmp_path / "reference"))
    assert check.verdict is None and not check.passed
    assert "no sample digests to compare after the resume at loop step 20" in check.boundaries[0].message
    assert "resume check: resumed against reference reference: unverified" in format_text(
        compare_runs([read_ledger(tmp_path / "resumed"), read_ledger(tmp_path / "reference")]), check)


def test_check_resume_needs_a_resumed_run(note_runs: tuple[Path, Path]) -> None:
    with pytest.raises(ConfigError, match="neither ledger has a resume record"):
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


def test_cli_json_and_text(note_runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "cli"
    # Hydra's spelling, list and all; the text run below uses the bare-argument and --key=value spellings.
    assert main([f"run_dirs=[{note_runs[0]},{note_runs[1]}]", "json=true", f"out={out_dir}"]) == 0
    payload = json.loads(capsys.readouterr().out)
    runs = payload["comparison"]["runs"]
    assert [(r["total"]["samples_seen"], r["total"]["optimizer_updates"]) for r in runs] == [(320, 40), (160, 20)]
    assert runs[1]["arithmetic"] == [{"batch_size": 2, "dp_world_size": 2, "grad_accum_steps": 2,
                                      "effective_batch_size": 8}]
    held_fixed = payload["comparison"]["held_fixed"]
    assert held_fixed["effective batch"] == {"quantity": "effective batch", "figures": [[8], [8]], "tolerance": None,
                                             "verdict": "held fixed"}
    assert held_fixed["compute budget"] == {"quantity": "compute budget", "figures": [[40.0], [80.0]],
                                            "tolerance": DEFAULT_TOLERANCE, "verdict": "not held fixed"}
    assert payload["resume_check"] is None
    assert Path(payload["plot"]).stat().st_size > 0 and Path(payload["report"]).is_file()

    assert main([*map(str, note_runs), f"--out={out_dir}"]) == 0
    out = capsys.readouterr().out
    assert "sample presentations (total)" in out and "not held fixed:" in out


def test_cli_check_resume_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    resumed, reference = _resumed_pair(tmp_path / "exact", diverge_from_update=None)
    assert main([str(resumed), str(reference), "--check-resume", "--out", str(tmp_path / "o1")]) == 0
    assert "resume check: resumed against reference reference: sample-exact" in capsys.readouterr().out

    resumed, reference = _resumed_pair(tmp_path / "diverged", diverge_from_update=11)
    assert main([str(reference), str(resumed), "check_resume=true", "json=true", f"out={tmp_path / 'o2'}"]) == 1
    check = json.loads(capsys.readouterr().out)["resume_check"]
    assert check["verdict"] == "not-exact"
    assert check["boundaries"][0]["first_divergence"][0]["optimizer_update"] == 11


def test_cli_user_errors(tmp_path: Path) -> None:
    # The script itself, in a process of its own: its exit status and stderr are what a user sees.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    script = [sys.executable, str(REPO_ROOT / "scripts" / "compare_runs.py")]
    completed = subprocess.run([*script, str(tmp_path), str(tmp_path)], capture_output=True, text=True, env=env,
                               timeout=120, check=False)
    assert completed.returncode == 2
    assert f"lerobot-mg-compare: error: {tmp_path}: has no ledger.jsonl" in completed.stderr
    completed = subprocess.run([*script, "--help"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert completed.returncode == 0
    assert "  check_resume=<true|false>  (default: false) with two runs, one resumed" in completed.stdout
