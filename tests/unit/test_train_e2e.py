"""End-to-end single-process runs of scripts/train.py on the real PushT slice: what a user sees."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.run_facts import RunFacts, from_dict
from tests.launch_utils import TINY_RUN, interval_metrics, last_weights, run_train

EXPECTED_PRETRAINED = {
    "config.json",
    "train_config.json",
    "model.safetensors",
    "policy_preprocessor.json",
    "policy_preprocessor_step_3_normalizer_processor.safetensors",
    "policy_postprocessor.json",
    "policy_postprocessor_step_0_unnormalizer_processor.safetensors",
}
EXPECTED_TRAINING_STATE = {
    "optimizer_param_groups.json",
    "optimizer_state.safetensors",
    "rng_state.safetensors",
    "scheduler_state.json",
    "training_step.json",
}


def test_short_run_lowers_loss_and_writes_the_guides_checkpoint_tree(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train([*TINY_RUN, "steps=40", "log_freq=10", "checkpoint.save_freq=20", f"output_dir={run_dir}",
                      "optimizer.lr=1e-3"])
    losses = [m["loss"] for m in interval_metrics(run_dir)]
    assert [m["step"] for m in interval_metrics(run_dir)] == [10, 20, 30, 40]
    assert losses[-1] < 0.5 * losses[0], losses
    # The time the loop waited for its batches (num_workers=0: it loads them itself), and its share of the interval.
    for m in interval_metrics(run_dir):
        assert 0 < m["data_wait_s"] < m["wall_time_s"] and 0 < m["data_frac"] < 1, m

    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["000020", "000040", "last"]
    assert (root / "last").is_symlink() and (root / "last").resolve() == (root / "000040").resolve()
    for step in ("000020", "000040"):
        assert {p.name for p in (root / step / "pretrained_model").iterdir()} == EXPECTED_PRETRAINED
        assert {p.name for p in (root / step / "training_state").iterdir()} == EXPECTED_TRAINING_STATE
    info = json.loads((root / "000040" / "training_state" / "training_step.json").read_text())
    assert info["step"] == 40 and info["facts"]["batch"] == {
        "batch_size": 8, "dp_world_size": 1, "grad_accum_steps": 1, "effective_batch_size": 8}
    assert info["facts"]["precision"] == "no" and info["facts"]["topology"]["layout"] == "single"
    assert info["progress"] == {"step": 40, "samples_seen": 320, "optimizer_updates": 40, "skipped_updates": 0}

    # One RunFacts, written as it is: into train_config.json, every checkpoint and the ledger; the banner prints it.
    facts = from_dict(RunFacts, info["facts"])
    saved = json.loads((run_dir / "train_config.json").read_text())
    assert from_dict(RunFacts, saved["run_facts"]) == facts
    ledger = read_ledger(run_dir)
    assert ledger.segments[0].start.facts == facts and ledger.segments[0].start.kind == "start"
    assert "\n  batch: batch_size 8 x dp_world_size 1 x grad_accum 1 = effective batch 8\n" in proc.stdout
    assert f"\n  {facts.describe()[3]}\n" in proc.stdout  # code revision and dataset fingerprint
    assert "40 loop steps = 320 sample presentations, 40 optimizer updates" in proc.stdout
    # One time series: the ledger's intervals (metrics.jsonl is gone); a digest of what was loaded per update.
    assert not (run_dir / "metrics.jsonl").exists()
    assert ledger.final_interval is not None and ledger.final_interval.progress.samples_seen == 320
    assert [u.optimizer_update for u in ledger.updates] == list(range(1, 41))
    assert len({u.digest for u in ledger.updates}) == 40 and {u.num_samples for u in ledger.updates} == {8}


def test_gradient_accumulation_counts_updates_and_effective_batch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train([*TINY_RUN, "steps=12", "batch_size=4", "accelerator.gradient_accumulation.steps=3",
                      "log_freq=6", f"output_dir={run_dir}", "checkpoint.save_checkpoint=false"])
    assert "batch_size 4 x dp_world_size 1 x grad_accum 3 = effective batch 12" in proc.stdout
    last = interval_metrics(run_dir)[-1]
    assert last["samples_seen"] == 48 and last["optimizer_updates"] == 4
    assert [(u.loop_step, u.num_samples) for u in read_ledger(run_dir).updates] == [(3, 12), (6, 12), (9, 12), (12, 12)]


def test_runs_without_output_dir_get_distinct_directories_and_wandb_offline_works(tmp_path: Path) -> None:
    overrides = [o for o in TINY_RUN if not o.startswith("logging.wandb")]
    first = run_train([*overrides, "steps=2", "logging.wandb.mode=offline"], cwd=tmp_path,
                      env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    second = run_train([*overrides, "steps=2", "--job_name=other"], cwd=tmp_path)
    runs = sorted(p for p in (tmp_path / "outputs" / "train").glob("*/*") if p.is_dir())
    assert len(runs) == 2 and runs[0] != runs[1]
    assert any(p.name.endswith("_other_" + p.name.rsplit("_", 1)[-1]) for p in runs)  # --key=value spelling
    offline = next(p for p in runs if "_other_" not in p.name)
    assert list((offline / "wandb").glob("offline-run-*")), "wandb offline run directory missing"
    assert str(offline) in first.stdout and "_other_" in second.stdout


# One 6-step run (a checkpoint every 2 steps, an interval every step) serves the tests below; they work on copies.
SIX_STEPS = [*TINY_RUN, "steps=6", "log_freq=1", "checkpoint.save_freq=2"]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("e2e") / "six_steps"
    run_train([*SIX_STEPS, f"output_dir={run_dir}"])
    return run_dir


def test_resume_errors_are_one_clear_line_before_any_training(six_steps: Path, tmp_path: Path) -> None:
    run_dir = shutil.copytree(six_steps, tmp_path / "run", symlinks=True)
    config = run_dir / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    ledger_before = (run_dir / "ledger.jsonl").read_text()

    finished = run_train(["resume=true", f"config_path={config}"], check=False, env={"HYDRA_FULL_ERROR": "0"})
    assert finished.returncode == 2
    assert "lerobot-mg-train: error: steps=6: the checkpoint to resume is already at loop step 6" in finished.stdout
    assert "Traceback" not in finished.stdout

    missing = run_train(["resume=true", f"config_path={tmp_path / 'nope' / 'train_config.json'}"], check=False,
                        env={"HYDRA_FULL_ERROR": "0"})
    assert missing.returncode == 2 and "does not exist" in missing.stdout and "Traceback" not in missing.stdout
    assert (run_dir / "ledger.jsonl").read_text() == ledger_before  # nothing was recorded, nothing lost


def test_an_lr_override_on_resume_takes_effect(six_steps: Path, tmp_path: Path) -> None:
    run_dir = shutil.copytree(six_steps, tmp_path / "run", symlinks=True)
    config = run_dir / "checkpoints" / "000004" / "pretrained_model" / "train_config.json"
    run_train(["resume=true", f"config_path={config}", "steps=6", "optimizer.lr=3e-4"])
    # Steps 5 and 6 of the first attempt (at ACT's preset lr, 1e-5) are superseded by the resume's.
    lrs = [(m["step"], m["lr"]) for m in interval_metrics(run_dir)]
    assert lrs == [(1, 1e-5), (2, 1e-5), (3, 1e-5), (4, 1e-5), (5, 3e-4), (6, 3e-4)]


def test_dataloader_workers_do_not_change_the_run(six_steps: Path, tmp_path: Path) -> None:
    run_train([*SIX_STEPS, "num_workers=2", f"output_dir={tmp_path / 'workers2'}"])
    with_workers, without = last_weights(tmp_path / "workers2"), last_weights(six_steps)
    assert with_workers.keys() == without.keys()
    assert all((with_workers[k] == without[k]).all() for k in without)
