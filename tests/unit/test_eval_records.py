"""Where evaluations go: the ledger's eval records (kept or superseded at a resume like intervals), each run's best
evaluation in lerobot-mg-compare's text and Markdown and the success and validation curves in its PNG; the split
that holds episodes out of training, and the validation loss that does not depend on how its batches are shared."""

from __future__ import annotations

from pathlib import Path

import torch

from lerobot_mg.accounting.compare import compare_runs
from lerobot_mg.accounting.ledger import EvalMetrics, EvalRecord, RunLedger, read_ledger
from lerobot_mg.accounting.report import format_markdown, format_text, plot_learning_curves
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.data.split import split_episodes
from lerobot_mg.evaluation import ValidationBatches, validation_loss
from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from lerobot_mg.policies.base import delta_timestamps
from lerobot_mg.run_facts import Progress
from tests.launch_utils import PUSHT_SLICE
from tests.unit.test_compare import CONFIG_A, CONFIG_B, PNG_MAGIC, simulate_run


def _evaluate(run_dir: Path, steps: list[int], success: list[float | None], val: list[float | None],
              samples_per_step: int) -> None:
    ledger = RunLedger(run_dir, is_main=True)
    for step, rate, loss in zip(steps, success, val):
        metrics = EvalMetrics(10 if rate is not None else 0, None if rate is None else round(rate * 10), rate,
                              None if rate is None else 50.0 * rate, 400.0, loss, 0 if loss is None else 96)
        ledger.write(EvalRecord(0.0, Progress(step, step * samples_per_step, step), 1.5, metrics))
    ledger.close()


def test_eval_records_are_read_back_and_cut_at_a_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    simulate_run(run, CONFIG_A, num_loop_steps=40, log_every=10)
    _evaluate(run, [10, 20, 30, 40], [0.1, 0.5, 0.4, 0.3], [0.9, 0.5, 0.6, 0.7], 8)
    simulate_run(run, CONFIG_A, num_loop_steps=40, log_every=10, start_step=20)  # redoes 21..40
    _evaluate(run, [30, 40], [0.2, 0.5], [0.4, 0.8], 8)
    record = read_ledger(run)
    assert [(e.progress.step, e.metrics.success_rate) for e in record.evals] == [(10, 0.1), (20, 0.5), (30, 0.2),
                                                                               (40, 0.5)]
    assert record.evals[0].metrics.tracker_metrics()["eval/val_loss"] == 0.9


def test_compare_lists_each_runs_best_evaluation_and_draws_its_curves(tmp_path: Path) -> None:
    simulate_run(tmp_path / "a", CONFIG_A, num_loop_steps=40, log_every=10)
    _evaluate(tmp_path / "a", [20, 40], [0.5, 0.5], [0.6, 0.4], 8)  # a tie: the earliest that reached it
    simulate_run(tmp_path / "b", CONFIG_B, num_loop_steps=40, log_every=10)
    _evaluate(tmp_path / "b", [20, 40], [None, None], [0.3, 0.2], 4)  # no simulator: validation loss only
    records = [read_ledger(tmp_path / name) for name in ("a", "b")]
    comparison = compare_runs(records)
    text = format_text(comparison, None)
    assert "a: best success rate 0.50 (5/10) at loop step 20 (160 samples, 20 updates)" in text
    assert "a: lowest val loss 0.4 (96 samples) at loop step 40 (320 samples, 40 updates)" in text
    assert "b: lowest val loss 0.2 (96 samples) at loop step 40 (160 samples, 40 updates)" in text
    assert "b: best success rate" not in text
    assert "## Best evaluations" in format_markdown(comparison, None, "curves.png")
    png = plot_learning_curves(records, tmp_path / "curves.png")
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_runs_without_evaluations_print_no_eval_section(tmp_path: Path) -> None:
    for name in ("a", "b"):
        simulate_run(tmp_path / name, CONFIG_A, num_loop_steps=20, log_every=10)
    assert "best evaluations" not in format_text(compare_runs([read_ledger(tmp_path / n) for n in "ab"]), None)


def test_the_split_holds_the_last_episodes_out_or_the_named_ones() -> None:
    meta = DatasetMeta.read(PUSHT_SLICE)  # 3 episodes
    assert split_episodes(meta, None, None).train is None
    split = split_episodes(meta, None, 1)
    assert (split.train, split.val) == ([0, 1], [2])
    split = split_episodes(meta, None, [0])
    assert (split.train, split.val) == ([1, 2], [0])
    split = split_episodes(meta, [0], [2, 1])  # dataset.episodes trains, as typed
    assert (split.train, split.val) == ([0], [1, 2])


def test_the_validation_loss_is_the_same_number_for_any_number_of_ranks() -> None:
    """The batches' sums, shared out over 1, 2 or 3 ranks (here, in one process) and combined, give one figure."""
    torch.manual_seed(0)
    config = ACTConfig(chunk_size=10, n_action_steps=10, dim_model=16, n_heads=2, dim_feedforward=32)
    policy = ACTPolicy(config, {"observation.state": {"type": "STATE", "shape": [2]}},
                       {"action": {"type": "ACTION", "shape": [2]}}).eval()
    meta = DatasetMeta.read(PUSHT_SLICE)
    val = LeRobotDataset(meta, delta_timestamps(config, meta.features, meta.fps), [2],
                         keys=["observation.state", "action"])
    batches = ValidationBatches(val, batch_size=16, seed=1000)
    assert sum(len(b) for b in batches.batches) == len(val) and len(batches.batches[-1]) < 16

    def combined(world_size: int) -> tuple[float, int]:
        sums = {}
        for rank in range(world_size):
            sums.update(batches.loss_sums(policy, lambda batch: batch, torch.device("cpu"), rank, world_size))
        return validation_loss(sums)

    assert combined(1) == combined(2) == combined(3)
    assert combined(1)[1] == len(val)
    assert ValidationBatches(val, batch_size=16, seed=1000, num_batches=2).batches == batches.batches[:2]
