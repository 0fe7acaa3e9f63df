"""The run ledger: batch arithmetic, digests, crash-safe appends and reading back resumed runs."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lerobot_mg.accounting.ledger import (
    LEDGER_FILENAME,
    BatchArithmetic,
    RunLedger,
    read_ledger,
    sample_digest,
)
from lerobot_mg.accounting.revision import code_revision


def _start(
    ledger: RunLedger, *, kind: str = "start", loop_step: int = 0, resumed_from: str | None = None
) -> None:
    arithmetic = BatchArithmetic(batch_size=2, dp_world_size=2, grad_accum_steps=2)
    ledger.record_start(
        kind=kind,
        loop_step=loop_step,
        samples_seen=arithmetic.sample_presentations(loop_step),
        optimizer_updates=arithmetic.optimizer_updates(loop_step),
        arithmetic=arithmetic,
        topology={"distributed_type": "FSDP", "dp_replicate": 1, "dp_shard": 2},
        world_size=2,
        precision="bf16",
        code_revision={"commit": "a" * 40, "dirty": False},
        dataset_fingerprint="embedded@v3:1234",
        checkpoint_format="dcp",
        resumed_from=resumed_from,
        lr_schedule={"type": "cosine", "lr": 1e-4, "warmup_steps": 2, "total_steps": 100},
        sampler_continuation="sample-exact" if kind == "resume" else None,
    )


def _interval(ledger: RunLedger, loop_step: int, loss: float) -> None:
    arithmetic = BatchArithmetic(batch_size=2, dp_world_size=2, grad_accum_steps=2)
    ledger.record_interval(
        loop_step=loop_step,
        samples_seen=arithmetic.sample_presentations(loop_step),
        optimizer_updates=arithmetic.optimizer_updates(loop_step),
        effective_batch_size=arithmetic.effective_batch_size,
        lr=1e-4,
        loss=loss,
        wall_time_s=0.5 * loop_step,
    )


def test_batch_arithmetic_reproduces_the_notes_table() -> None:
    config_a = BatchArithmetic(batch_size=32, dp_world_size=1, grad_accum_steps=1)
    config_b = BatchArithmetic(batch_size=8, dp_world_size=2, grad_accum_steps=4)
    assert (config_a.sample_presentations(100), config_a.optimizer_updates(100)) == (3200, 100)
    assert (config_b.sample_presentations(100), config_b.optimizer_updates(100)) == (1600, 25)
    assert config_b.effective_batch_size == 64
    assert config_b.samples_per_loop_step == 16
    assert config_b.banner() == "batch_size 8 x dp_world_size 2 x grad_accum 4 = effective batch 64"
    # A partial accumulation window is not an update.
    assert config_b.optimizer_updates(7) == 1


def test_batch_arithmetic_rejects_non_positive_values() -> None:
    with pytest.raises(ValueError, match=r"grad_accum_steps must be a positive integer, got 0"):
        BatchArithmetic(batch_size=8, dp_world_size=1, grad_accum_steps=0)
    with pytest.raises(ValueError, match=r"loop_steps must be >= 0, got -1"):
        BatchArithmetic(batch_size=8, dp_world_size=1, grad_accum_steps=1).sample_presentations(-1)


def test_sample_digest_is_stable_and_order_sensitive() -> None:
    digest = sample_digest([3, 1, 2])
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert sample_digest(np.array([3, 1, 2], dtype=np.int32)) == digest
    assert sample_digest([1, 2, 3]) != digest
    assert sample_digest([3, 1, 2, 4]) != digest
    with pytest.raises(ValueError, match="integer sample indices"):
        sample_digest([0.5, 1.0])  # type: ignore[list-item]


def test_ledger_round_trip(tmp_path: Path) -> None:
    with RunLedger(tmp_path, is_main=True) as ledger:
        _start(ledger)
        for step in (1, 2, 3, 4):
            if step % 2 == 0:
                ledger.record_update(
                    optimizer_update=step // 2, loop_step=step, digest=f"{step:016x}", num_samples=8
                )
        _interval(ledger, 4, loss=0.75)
    lines = (tmp_path / LEDGER_FILENAME).read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["start", "update", "update", "interval"]

    record = read_ledger(tmp_path)
    assert len(record.segments) == 1 and record.num_skipped_lines == 0
    start = record.first_start
    assert start.arithmetic == BatchArithmetic(2, 2, 2)
    assert start.topology == {"distributed_type": "FSDP", "dp_replicate": 1, "dp_shard": 2}
    assert start.lr_schedule["type"] == "cosine" and start.checkpoint_format == "dcp"
    final = record.final_interval
    assert final is not None
    assert (final.loop_step, final.samples_seen, final.optimizer_updates, final.loss) == (4, 16, 2, 0.75)
    assert [u.optimizer_update for u in record.updates] == [1, 2]
    assert record.total_wall_time_s == 2.0


def test_a_diverged_loss_round_trips(tmp_path: Path) -> None:
    with RunLedger(tmp_path, is_main=True) as ledger:
        _start(ledger)
        _interval(ledger, 1, loss=float("nan"))
    final = read_ledger(tmp_path).final_interval
    assert final is not None and math.isnan(final.loss)


def test_non_main_process_writes_nothing(tmp_path: Path) -> None:
    ledger = RunLedger(tmp_path / "run", is_main=False)
    _start(ledger)
    _interval(ledger, 1, loss=1.0)
    ledger.close()
    assert not (tmp_path / "run").exists()


def test_truncated_last_line_is_tolerated_and_the_next_start_begins_a_fresh_line(tmp_path: Path) -> None:
    with RunLedger(tmp_path, is_main=True) as ledger:
        _start(ledger)
        _interval(ledger, 2, loss=1.0)
    path = tmp_path / LEDGER_FILENAME
    with open(path, "a") as file:  # a crash mid-write
        file.write('{"kind": "interval", "loop_step": 4, "samp')
    record = read_ledger(tmp_path)
    assert record.num_skipped_lines == 1
    assert [r.loop_step for r in record.intervals] == [2]

    with RunLedger(tmp_path, is_main=True) as ledger:
        _start(ledger, kind="resume", loop_step=2, resumed_from="checkpoints/000002")
        _interval(ledger, 4, loss=0.5)
    record = read_ledger(tmp_path)
    assert record.num_skipped_lines == 1
    assert [s.start.kind for s in record.segments] == ["start", "resume"]
    assert [(r.loop_step, r.loss) for r in record.intervals] == [(2, 1.0), (4, 0.5)]


def test_unreadable_line_inside_a_segment_is_an_error(tmp_path: Path) -> None:
    with RunLedger(tmp_path, is_main=True) as ledger:
        _start(ledger)
        _interval(ledger, 1, loss=1.0)
    path = tmp_path / LEDGER_FILENAME
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    with pytest.raises(ValueError, match=r"ledger.jsonl:2: unreadable line in the middle of a run segment"):
        read_ledger(tmp_path)


def test_resume_after_a_crash_keeps_the_latest_attempt(tmp_path: Path) -> None:
    # Crash at step 70, resume from the step-50 checkpoint, re-log steps 51-70 and carry on to 90.
    with RunLedger(tmp_path, is_main=True) as ledger:
        _start(ledger)
        for step in range(10, 71, 10):
            _interval(ledger, step, loss=1.0)
            ledger.record_update(optimizer_update=step // 2, loop_step=step, digest="first", num_samples=8)
    with RunLedger(tmp_path, is_main=True) as ledger:
        _start(ledger, kind="resume", loop_step=50, resumed_from="checkpoints/000050")
        for step in range(60, 91, 10):
            _interval(ledger, step, loss=0.5)
            ledger.record_update(optimizer_update=step // 2, loop_step=step, digest="second", num_samples=8)
    record = read_ledger(tmp_path)
    assert [(r.loop_step, r.loss) for r in record.intervals] == [
        (10, 1.0),
        (20, 1.0),
        (30, 1.0),
        (40, 1.0),
        (50, 1.0),
        (60, 0.5),
        (70, 0.5),
        (80, 0.5),
        (90, 0.5),
    ]
    assert [u.digest for u in record.updates] == ["first"] * 5 + ["second"] * 4
    # Wall time counts each attempt up to what was kept: 25 s to step 50, then 45 s in the second attempt.
    assert record.total_wall_time_s == 25.0 + 45.0
    assert record.segment_at(50).start.kind == "start"
    assert record.segment_at(51).start.kind == "resume"
    assert not any(record.superseded(segment) for segment in record.segments)


def test_an_attempt_wholly_redone_is_superseded(tmp_path: Path) -> None:
    with RunLedger(tmp_path, is_main=True) as ledger:
        _start(ledger)
        _interval(ledger, 50, loss=1.0)
    with RunLedger(tmp_path, is_main=True) as ledger:  # resumed from 50, crashed at 60
        _start(ledger, kind="resume", loop_step=50, resumed_from="checkpoints/000050")
        _interval(ledger, 60, loss=0.9)
    with RunLedger(tmp_path, is_main=True) as ledger:  # the step-50 checkpoint was bad: back to 40
        _start(ledger, kind="resume", loop_step=40, resumed_from="checkpoints/000040")
        _interval(ledger, 60, loss=0.8)
    record = read_ledger(tmp_path)
    assert [record.superseded(segment) for segment in record.segments] == [False, True, False]
    assert [(r.loop_step, r.loss) for r in record.intervals] == [(60, 0.8)]


def test_reader_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no ledger.jsonl: pass a run directory"):
        read_ledger(tmp_path)
    (tmp_path / LEDGER_FILENAME).write_text('{"kind": "interval", "loop_step": 1}\n{"kind": "start"}\n')
    with pytest.raises(ValueError, match=r"ledger.jsonl:1: a 'interval' record before any start record"):
        read_ledger(tmp_path)
    ledger = RunLedger(tmp_path / "other", is_main=True)
    with pytest.raises(ValueError, match=r"needs resumed_from"):
        _start(ledger, kind="resume", loop_step=10)
    with pytest.raises(ValueError, match=r"kind must be one of \('start', 'resume'\), got 'restart'"):
        _start(ledger, kind="restart")
    ledger.close()


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
    )


def test_code_revision_reports_commit_and_dirty_flag(tmp_path: Path) -> None:
    assert code_revision(tmp_path) == {"commit": None, "dirty": None}
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "module.py").write_text("x = 1\n")
    assert code_revision(repo) == {"commit": None, "dirty": True}
    _git(repo, "add", "module.py")
    _git(repo, "commit", "-q", "-m", "init")
    revision = code_revision(repo)
    assert revision["dirty"] is False
    assert isinstance(revision["commit"], str) and len(revision["commit"]) == 40
    (repo / "module.py").write_text("x = 2\n")
    assert code_revision(repo) == {"commit": revision["commit"], "dirty": True}
