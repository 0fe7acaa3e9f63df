"""lerobot-mg-compare on REAL short runs: two configurations with the same effective batch, and resumed runs.

8x1x1 vs 2x2x2 (microbatch x workers x accumulation) over 8 loop steps: 64 vs 32 sample presentations, 8 vs 4
optimizer updates, the same effective batch of 8 (docs/comparing-runs.md). Only exact quantities are asserted on
these runs: their wall times, and so the verdict on the compute budget, depend on the machine, and
tests/unit/test_compare.py asserts that verdict on ledgers whose times it writes itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.checkpoint.state import read_json
from lerobot_mg.scripts_entry import compare_runs as compare
from tests.launch_utils import TINY_RUN, TRAIN_SCRIPT, run_train

pytestmark = pytest.mark.dist

# The real trainer, with a DataLoader that delivers one wrong sample: the 11th frame fetched in this process (the
# 3rd sample of the 2nd micro-batch after the resume) is its neighbour. The sampler never knows.
ONE_WRONG_SAMPLE = """
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.scripts_entry import train

_getitem, fetched = LeRobotDataset.__getitem__, []


def one_wrong_sample(self, idx):
    fetched.append(idx)
    return _getitem(self, (idx + 1) % len(self) if len(fetched) == 11 else idx)


LeRobotDataset.__getitem__ = one_wrong_sample
train()
"""


def _resume(run_dir: Path, overrides: list[str], nproc: int, script: Path | None = None) -> None:
    config = run_dir / "checkpoints" / "000004" / "pretrained_model" / "train_config.json"
    args = ["resume=true", f"config_path={config}", "steps=8", "logging.progress_bar=false", *overrides]
    run_train(args, nproc=nproc, script=script or TRAIN_SCRIPT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    common = [*TINY_RUN, "log_freq=2"]
    names = ("a_8x1x1", "b_2x2x2", "resumed_same", "resumed_split", "resumed_wider", "resumed_one_wrong_sample")
    out = {name: root / name for name in names}
    run_train([*common, "batch_size=8", "steps=8", "checkpoint.save_freq=4", f"output_dir={out['a_8x1x1']}"])
    run_train([*common, "batch_size=2", "accelerator.gradient_accumulation.steps=2", "steps=8",
               f"output_dir={out['b_2x2x2']}"], nproc=2)
    # The reference run, copied and resumed four ways from its step-4 checkpoint (steps 5-8 run again).
    for name in names[2:]:
        shutil.copytree(out["a_8x1x1"], out[name], symlinks=True)
    _resume(out["resumed_same"], [], nproc=1)  # same topology and batch
    _resume(out["resumed_split"], ["batch_size=4"], nproc=2)  # same global batch 8 = 4 x 2 ranks
    _resume(out["resumed_wider"], [], nproc=2)  # global batch 16: the stream changes
    probe = root / "one_wrong_sample.py"
    probe.write_text(ONE_WRONG_SAMPLE)
    _resume(out["resumed_one_wrong_sample"], [], nproc=1, script=probe)  # same topology and batch
    return out


def _check(runs: dict[str, Path], resumed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    status = compare([str(runs[resumed]), str(runs["a_8x1x1"]), "check_resume=true", "json=true", f"out={tmp_path}"])
    return status, json.loads(capsys.readouterr().out)["resume_check"]


def test_the_notes_configurations_give_the_arithmetic_and_name_what_was_held_fixed(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert compare([str(runs["a_8x1x1"]), str(runs["b_2x2x2"]), "--json", "--out", str(tmp_path / "report")]) == 0
    report = json.loads(capsys.readouterr().out)
    a, b = report["comparison"]["runs"]
    assert a["arithmetic"] == [{"batch_size": 8, "dp_world_size": 1, "grad_accum_steps": 1, "effective_batch_size": 8}]
    assert b["arithmetic"] == [{"batch_size": 2, "dp_world_size": 2, "grad_accum_steps": 2, "effective_batch_size": 8}]
    assert (a["total"]["step"], a["total"]["samples_seen"], a["total"]["optimizer_updates"]) == (8, 64, 8)
    assert (b["total"]["step"], b["total"]["samples_seen"], b["total"]["optimizer_updates"]) == (8, 32, 4)
    held = {quantity: verdict["verdict"] for quantity, verdict in report["comparison"]["held_fixed"].items()}
    assert (held["effective batch"], held["data exposure"], held["update count"]) == (
        "held fixed", "not held fixed", "not held fixed")
    # The compute budget's verdict depends on this machine's speed; its figures are the ledgers' own, unrounded.
    budget = report["comparison"]["held_fixed"]["compute budget"]
    assert budget["tolerance"] == 0.1 and budget["figures"] == [[a["compute_budget_worker_s"]],
                                                                [b["compute_budget_worker_s"]]]
    assert a["compute_budget_worker_s"] == read_ledger(runs["a_8x1x1"]).total_wall_time_s  # 1 worker
    assert b["compute_budget_worker_s"] == 2 * read_ledger(runs["b_2x2x2"]).total_wall_time_s  # 2 workers

    png, md = tmp_path / "report" / "learning_curves.png", tmp_path / "report" / "report.md"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    markdown = md.read_text()
    assert "](learning_curves.png)" in markdown
    for row in ("| effective batch | 8 | 8 |", "| sample presentations (total) | 64 | 32 |",
                "| optimizer updates (total) | 8 | 4 |", "| data-parallel workers | 1 | 2 |"):
        assert row in markdown, row
    assert "- sample presentations (total) differs: a_8x1x1 64, b_2x2x2 32" in markdown

    assert compare([str(runs["a_8x1x1"]), str(runs["b_2x2x2"]), "--out", str(tmp_path / "text")]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Where the compute budget goes (held or not) is the machine's; the counts are the configurations'.
    held_line, varied_line = next((i, i + 1) for i, line in enumerate(lines) if line.startswith("held fixed: "))
    assert lines[held_line].removesuffix(", compute budget") == "held fixed: effective batch"
    assert lines[varied_line].removesuffix(", compute budget") == "not held fixed: data exposure, update count"
    assert lines[varied_line + 1].startswith("compute budget (worker-seconds) ")
    assert lines[varied_line + 1].endswith("the tolerance of 10 % (tolerance=0.1)")


def test_check_resume_is_sample_exact_on_the_same_topology(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, check = _check(runs, "resumed_same", tmp_path, capsys)
    assert status == 0 and check["verdict"] == "sample-exact", check
    assert check["boundaries"][0]["loop_step"] == 4
    assert (check["boundaries"][0]["num_compared_before"], check["boundaries"][0]["num_compared_after"]) == (4, 4)


def test_check_resume_with_the_same_global_batch_on_two_ranks_is_global_batch_exact(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Beyond the guide: batch 8 x 1 rank -> 4 x 2 ranks keeps the global batches, so every update trains on the
    # same samples; each rank sees others than before. One word for that, from start-up log to check.
    status, check = _check(runs, "resumed_split", tmp_path, capsys)
    assert status == 0 and check["verdict"] == "global-batch-exact", check
    assert compare([str(runs["resumed_split"]), str(runs["a_8x1x1"]), f"out={tmp_path / 't'}"]) == 0
    conditions = capsys.readouterr().out.split("resume conditions:")[1]
    resumed_split, reference = conditions.split("\na_8x1x1:\n")
    lines = [line.strip() for line in resumed_split.splitlines()]
    origin = f"from {runs['resumed_split']}/checkpoints/000004"
    assert f"resume at loop step 4 (update 4) {origin} (requested): global-batch-exact" in lines
    assert ("FLAG: steps 5-8 re-run at resume (step 4): the previous attempt reached step 8; its records past the "
            "resume step are superseded") in lines
    assert "FLAG: topology changed at resume (step 4): single process -> DDP: 2 replicas" in lines
    assert ("FLAG: batch changed at resume (step 4): batch_size 8 x dp_world_size 1 x grad_accum 1 = effective batch "
            "8 -> batch_size 4 x dp_world_size 2 x grad_accum 1 = effective batch 8") in lines
    assert "changed at" not in reference
    saved = json.loads((runs["resumed_split"] / "train_config.json").read_text())  # a resume keeps the original
    assert saved["run_facts"]["topology"]["layout"] == "single"


def test_check_resume_reports_where_a_changed_world_size_diverges(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, check = _check(runs, "resumed_wider", tmp_path, capsys)
    assert status == 1 and check["verdict"] == "not-exact"
    resumed, reference = check["boundaries"][0]["first_divergence"]
    assert (resumed["optimizer_update"], resumed["loop_step"]) == (5, 5)  # the first update after the resume
    assert (resumed["num_samples"], reference["num_samples"]) == (16, 8)


def test_check_resume_catches_a_loader_that_delivered_one_wrong_sample(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, check = _check(runs, "resumed_one_wrong_sample", tmp_path, capsys)
    assert status == 1 and check["verdict"] == "not-exact", check
    (boundary,) = check["boundaries"]
    assert boundary["message"].startswith("diverges at optimizer update 6 (loop step 6), 2 update(s) after the resume "
                                          "at loop step 4")
    # Exactly the update with the wrong sample differs; the loader was right before and after it.
    faulty, reference = read_ledger(runs["resumed_one_wrong_sample"]).updates, read_ledger(runs["a_8x1x1"]).updates
    assert [mine.digest == theirs.digest for mine, theirs in zip(faulty, reference)] == [True] * 5 + [False, True, True]
    # The sampler's own account is untouched (same position as the reference), so a digest computed from the
    # sampler's indices, as before, would have called this resume sample-exact.
    assert [read_json(run / "checkpoints" / "last" / "training_state" / "training_step.json")["sampler"]
            for run in (runs["resumed_one_wrong_sample"], runs["a_8x1x1"])] == [{"epoch": 0, "offset": 64,
                                                                                  "seed": 1000, "num_samples": 420}] * 2
