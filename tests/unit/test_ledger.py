"""Run facts, the ledger and the loader digests: arithmetic, typed round trips, crash-safe appends, resumed runs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lerobot_mg.accounting.compare import counts_at, summarize_run
from lerobot_mg.accounting.ledger import (
    LEDGER_FILENAME,
    IntervalRecord,
    RunLedger,
    StartRecord,
    UpdateDigest,
    read_ledger,
)
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Continuation, Topology
from lerobot_mg.errors import ConfigError
from lerobot_mg.run_facts import CodeRevision, FactChange, Progress, ResumeCause, RunFacts
from lerobot_mg.tracking import LoaderDigests

ARITHMETIC = BatchArithmetic(batch_size=2, dp_world_size=2, grad_accum_steps=2)
FACTS = RunFacts(
    batch=ARITHMETIC,
    topology=Topology(dp_replicate=1, dp_shard=2, world_size=2),
    precision="bf16",
    checkpoint_format="dcp",
    code_revision=CodeRevision("a" * 40, dirty=False),
    dataset_fingerprint="embedded@v3:1234",
    lr_schedule={"type": "cosine", "lr": 1e-4, "warmup_steps": 2, "total_steps": 100},
    model={"total_params": 1000, "trainable_params": 1000, "base_model_path": None, "peft": None},
    rank_bytes=({"parameters": 2000, "trainable_parameters": 2000}, {"parameters": 2000, "trainable_parameters": 2000}),
)


def _progress(loop_step: int) -> Progress:
    return Progress(loop_step, ARITHMETIC.sample_presentations(loop_step), ARITHMETIC.optimizer_updates(loop_step))


def _start(ledger: RunLedger, loop_step: int = 0, resumed_from: str | None = None) -> StartRecord:
    facts = FACTS if resumed_from is None else dataclasses.replace(
        FACTS, resumed_from=resumed_from, continuation=Continuation.SAMPLE_EXACT)
    record = StartRecord(1.5, _progress(loop_step), facts)
    ledger.write(record)
    return record


def _interval(ledger: RunLedger, loop_step: int, loss: float, digest: str = "0" * 12) -> IntervalRecord:
    updates = (UpdateDigest(ARITHMETIC.optimizer_updates(loop_step), loop_step, digest, 8),)
    record = IntervalRecord(2.5, _progress(loop_step), 0.5 * loop_step, {"loss": loss, "lr": 1e-4}, updates)
    ledger.write(record)
    return record


def test_batch_arithmetic_reproduces_the_notes_table() -> None:
    config_a = BatchArithmetic(batch_size=32, dp_world_size=1, grad_accum_steps=1)
    config_b = BatchArithmetic(batch_size=8, dp_world_size=2, grad_accum_steps=4)
    assert (config_a.sample_presentations(100), config_a.optimizer_updates(100)) == (3200, 100)
    assert (config_b.sample_presentations(100), config_b.optimizer_updates(100)) == (1600, 25)
    assert config_b.effective_batch_size == 64
    assert config_b.samples_per_loop_step == 16
    assert config_b.describe() == "batch_size 8 x dp_world_size 2 x grad_accum 4 = effective batch 64"
    # A partial accumulation window is not an update.
    assert config_b.optimizer_updates(7) == 1
    # The derived field is written for readers, and never read back.
    assert dataclasses.asdict(config_b)["effective_batch_size"] == 64


def test_batch_arithmetic_rejects_non_positive_values() -> None:
    with pytest.raises(ValueError, match=r"grad_accum_steps must be a positive integer, got 0"):
        BatchArithmetic(batch_size=8, dp_world_size=1, grad_accum_steps=0)
    with pytest.raises(ValueError, match=r"loop_steps must be >= 0, got -1"):
        BatchArithmetic(batch_size=8, dp_world_size=1, grad_accum_steps=1).sample_presentations(-1)


def _digests(global_batches: list[list[int]], arithmetic: BatchArithmetic) -> list[UpdateDigest]:
    """Each rank digests its slices of the global batches (one global batch per loop step), then the packed
    sums are added over ranks as the metrics all-reduce does."""
    ranks = [LoaderDigests(arithmetic, rank) for rank in range(arithmetic.dp_world_size)]
    b = arithmetic.batch_size
    for step, global_batch in enumerate(global_batches, start=1):
        for rank, digests in enumerate(ranks):
            digests.add(torch.tensor(global_batch[rank * b : (rank + 1) * b]))
            if step % arithmetic.grad_accum_steps == 0:
                digests.end_update(step // arithmetic.grad_accum_steps, step)
    summed = [sum(values) for values in zip(*(digests.pack() for digests in ranks))]
    return list(ranks[0].unpack(summed))


def test_loader_digests_follow_the_samples_not_the_split() -> None:
    stream = [(7 * i + 3) % 1000 + 10**9 for i in range(48)]  # large indices: the hash works on 64-bit values
    single = _digests([stream[i : i + 8] for i in range(0, 48, 8)], BatchArithmetic(8, 1, 1))
    assert [(d.optimizer_update, d.loop_step, d.num_samples) for d in single] == [(u, u, 8) for u in range(1, 7)]
    assert len({d.digest for d in single}) == 6 and all(len(d.digest) == 12 for d in single)
    # The same global batches split over 4 ranks, or over 2 ranks and 2 micro-steps per update.
    assert [d.digest for d in _digests([stream[i : i + 8] for i in range(0, 48, 8)], BatchArithmetic(2, 4, 1))] == [
        d.digest for d in single]
    accumulated = _digests([stream[i : i + 4] for i in range(0, 48, 4)], BatchArithmetic(2, 2, 2))
    assert [(d.optimizer_update, d.loop_step, d.digest) for d in accumulated] == [
        (d.optimizer_update, 2 * d.loop_step, d.digest) for d in single]

    wrong = list(stream)
    wrong[19] += 1  # one wrong sample in update 3
    assert [a.digest == b.digest for a, b in zip(_digests([wrong[i : i + 8] for i in range(0, 48, 8)],
                                                          BatchArithmetic(8, 1, 1)), single)] == [
        True, True, False, True, True, True]
    swapped = list(stream)
    swapped[40], swapped[41] = swapped[41], swapped[40]  # the same samples in another order, in update 6
    assert _digests([swapped[i : i + 8] for i in range(0, 48, 8)], BatchArithmetic(8, 1, 1))[5].digest != (
        single[5].digest)


def test_ledger_round_trip_is_typed_and_exact(tmp_path: Path) -> None:
    with_ledger = RunLedger(tmp_path, is_main=True)
    written = [_start(with_ledger), _interval(with_ledger, 2, loss=1.0), _interval(with_ledger, 4, loss=0.75)]
    with_ledger.close()
    lines = [json.loads(line) for line in (tmp_path / LEDGER_FILENAME).read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["start", "interval", "interval"]
    assert lines[0]["facts"]["batch"] == {"batch_size": 2, "dp_world_size": 2, "grad_accum_steps": 2,
                                          "effective_batch_size": 8}
    assert lines[0]["facts"]["topology"]["layout"] == "fsdp"

    record = read_ledger(tmp_path)
    assert len(record.segments) == 1
    assert (record.segments[0].start, *record.intervals) == tuple(written)  # dataclasses, nested, equal field by field
    final = record.final_interval
    assert final is not None and final.progress == Progress(4, 16, 2) and final.metrics["loss"] == 0.75
    assert [u.optimizer_update for u in record.updates] == [1, 2]
    assert record.total_wall_time_s == 2.0


def test_wall_times_are_stored_unrounded(tmp_path: Path) -> None:
    """The comparison's verdict on the compute budget reads the ledger's wall times: they come back to the bit, and
    the budget is built from them unrounded (rounding is the report's, for display)."""
    ledger = RunLedger(tmp_path, is_main=True)
    _start(ledger)
    wall_times = (0.1 + 2**-40, 0.123456789012345678)
    for loop_step, wall_time_s in zip((2, 4), wall_times):
        ledger.write(IntervalRecord(2.5, _progress(loop_step), wall_time_s, {"loss": 1.0, "lr": 1e-4}))
    ledger.close()
    record = read_ledger(tmp_path)
    assert tuple(interval.wall_time_s for interval in record.intervals) == wall_times
    assert record.total_wall_time_s == wall_times[-1]
    # FACTS runs on 2 ranks: 2 workers x the wall time, exactly.
    assert summarize_run(record, "run", 4).compute_budget_worker_s == 2 * wall_times[-1]


def test_lines_are_flushed_but_fsynced_only_at_checkpoints_and_close(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    ledger = RunLedger(tmp_path, is_main=True)
    _start(ledger)
    synced.clear()
    for step in range(1, 101):
        _interval(ledger, step, loss=1.0)
    assert synced == []  # no fsync on the hot path...
    assert len(read_ledger(tmp_path).intervals) == 100  # ...yet every line is readable (flushed) already
    ledger.sync()
    assert synced  # a checkpoint boundary
    synced.clear()
    ledger.close()
    assert synced


def test_a_diverged_loss_round_trips(tmp_path: Path) -> None:
    ledger = RunLedger(tmp_path, is_main=True)
    _start(ledger)
    _interval(ledger, 1, loss=float("nan"))
    ledger.close()
    final = read_ledger(tmp_path).final_interval
    assert final is not None and math.isnan(final.metrics["loss"])


def test_non_main_process_writes_nothing(tmp_path: Path) -> None:
    ledger = RunLedger(tmp_path / "run", is_main=False)
    _start(ledger)
    _interval(ledger, 1, loss=1.0)
    ledger.sync()
    ledger.close()
    assert not (tmp_path / "run").exists()


def test_truncated_last_line_is_tolerated_and_the_next_start_begins_a_fresh_line(tmp_path: Path) -> None:
    ledger = RunLedger(tmp_path, is_main=True)
    _start(ledger)
    _interval(ledger, 2, loss=1.0)
    ledger.close()
    with open(tmp_path / LEDGER_FILENAME, "a") as file:  # a crash mid-write
        file.write('{"kind": "interval", "progress": {"step": 4, "samp')
    assert [r.progress.step for r in read_ledger(tmp_path).intervals] == [2]

    ledger = RunLedger(tmp_path, is_main=True)
    _start(ledger, loop_step=2, resumed_from="checkpoints/000002")
    _interval(ledger, 4, loss=0.5)
    ledger.close()
    record = read_ledger(tmp_path)
    assert [s.start.kind for s in record.segments] == ["start", "resume"]
    assert [(r.progress.step, r.metrics["loss"]) for r in record.intervals] == [(2, 1.0), (4, 0.5)]


def test_unreadable_line_inside_a_segment_is_an_error(tmp_path: Path) -> None:
    ledger = RunLedger(tmp_path, is_main=True)
    _start(ledger)
    _interval(ledger, 1, loss=1.0)
    ledger.close()
    path = tmp_path / LEDGER_FILENAME
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    with pytest.raises(ConfigError, match=r"ledger.jsonl:2: unreadable line in the middle of a run segment"):
        read_ledger(tmp_path)


def test_resume_after_a_crash_keeps_the_latest_attempt(tmp_path: Path) -> None:
    # Crash at step 70, resume from the step-50 checkpoint, log steps 51-70 again and carry on to 90.
    ledger = RunLedger(tmp_path, is_main=True)
    _start(ledger)
    for step in range(10, 71, 10):
        _interval(ledger, step, loss=1.0, digest="first")
    ledger.close()
    ledger = RunLedger(tmp_path, is_main=True)
    _start(ledger, loop_step=50, resumed_from="checkpoints/000050")
    for step in range(60, 91, 10):
        _interval(ledger, step, loss=0.5, digest="second")
    ledger.close()
    record = read_ledger(tmp_path)
    assert [(r.progress.step, r.metrics["loss"]) for r in record.intervals] == [
        (10, 1.0), (20, 1.0), (30, 1.0), (40, 1.0), (50, 1.0), (60, 0.5), (70, 0.5), (80, 0.5), (90, 0.5)]
    assert [u.digest for u in record.updates] == ["first"] * 5 + ["second"] * 4
    # Wall time counts each attempt up to what was kept: 25 s to step 50, then 45 s in the second attempt.
    assert record.total_wall_time_s == 25.0 + 45.0
    # Counts between logged steps come from the attempt that trained them: the resume, past step 50.
    assert counts_at(record, 50) == (Progress(50, 200, 25), True)
    assert counts_at(record, 55) == (Progress(55, 220, 27), False)
    assert not any(record.superseded(segment) for segment in record.segments)


def test_an_attempt_wholly_redone_is_superseded(tmp_path: Path) -> None:
    for resumed_from, step, loss in ((None, 0, 1.0), ("checkpoints/000050", 50, 0.9), ("checkpoints/000040", 40, 0.8)):
        ledger = RunLedger(tmp_path, is_main=True)  # resumed from 50 and crashed; then the 50 was bad: back to 40
        _start(ledger, loop_step=step, resumed_from=resumed_from)
        _interval(ledger, 60 if step else 50, loss=loss)
        ledger.close()
    record = read_ledger(tmp_path)
    assert [record.superseded(segment) for segment in record.segments] == [False, True, False]
    assert [(r.progress.step, r.metrics["loss"]) for r in record.intervals] == [(60, 0.8)]


def test_reader_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no ledger.jsonl, it is not a run directory"):
        read_ledger(tmp_path)
    path = tmp_path / LEDGER_FILENAME
    path.write_text('{"kind": "interval", "progress": {}}\n')
    with pytest.raises(ConfigError, match=r"ledger.jsonl:1: expected a start, resume, interval, eval or stop record after a "
                                         r"start record, got kind 'interval'"):
        read_ledger(tmp_path)
    path.write_text('{"kind": "start", "time": 1.0}\n')
    with pytest.raises(ConfigError, match=r"ledger.jsonl:1: malformed 'start' record"):
        read_ledger(tmp_path)


def test_resume_differences_are_typed_and_rendered_once() -> None:
    resumed = dataclasses.replace(
        FACTS, batch=BatchArithmetic(4, 1, 2), topology=Topology(1, 1, 1), dataset_fingerprint="embedded:xyz",
        rank_bytes=({"parameters": 4000, "trainable_parameters": 4000},),  # follows from the topology: not a change
        resumed_from="checkpoints/000020", continuation=Continuation.NOT_EXACT, resume_cause=ResumeCause.PREEMPTION)
    changes = resumed.changes_since(FACTS)
    assert [change.name for change in changes] == ["batch", "topology", "dataset_fingerprint"]
    assert changes[1] == FactChange("topology", Topology(1, 2, 2), Topology(1, 1, 1))
    assert changes[1].describe("at resume (step 20)") == (
        "topology changed at resume (step 20): FSDP2: 2 shards -> single process")
    assert changes[2].describe("here") == "dataset fingerprint changed here: embedded@v3:1234 -> embedded:xyz"
    assert dataclasses.replace(FACTS, resumed_from="x", continuation=Continuation.SAMPLE_EXACT).changes_since(
        FACTS) == ()


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ((8, 1, 1), (8, 1, 1), Continuation.SAMPLE_EXACT),
        ((8, 1, 1), (4, 2, 1), Continuation.GLOBAL_BATCH_EXACT),  # same global batch, another split
        ((8, 2, 2), (4, 4, 2), Continuation.GLOBAL_BATCH_EXACT),
        ((8, 1, 1), (8, 2, 1), Continuation.NOT_EXACT),  # the global batch grew
        ((8, 1, 1), (4, 1, 2), Continuation.NOT_EXACT),  # same effective batch, other updates and epoch ends
    ],
)
def test_continuation_is_judged_from_the_batch_arithmetic(before: tuple, after: tuple,
                                                          expected: Continuation) -> None:
    assert Continuation.of_resume(BatchArithmetic(*before), BatchArithmetic(*after)) is expected


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   check=True, capture_output=True)


def test_code_revision_reports_commit_and_dirty_flag(tmp_path: Path) -> None:
    assert CodeRevision.of_checkout(tmp_path) == CodeRevision(None, None)
    assert CodeRevision(None, None).describe() == "unknown (dirty: unknown)"
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "module.py").write_text("x = 1\n")
    assert CodeRevision.of_checkout(repo) == CodeRevision(None, True)
    _git(repo, "add", "module.py")
    _git(repo, "commit", "-q", "-m", "init")
    revision = CodeRevision.of_checkout(repo)
    assert revision.dirty is False and isinstance(revision.commit, str) and len(revision.commit) == 40
    (repo / "module.py").write_text("x = 2\n")
    assert CodeRevision.of_checkout(repo) == CodeRevision(revision.commit, True)
    assert CodeRevision.of_checkout(repo).describe() == f"{revision.commit[:12]} (dirty)"
