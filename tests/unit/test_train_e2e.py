"""End-to-end single-process runs of scripts/train.py on the real PushT slice: what a user sees."""

from __future__ import annotations

import json
from pathlib import Path

from tests.launch_utils import TINY_RUN, run_train

EXPECTED_PRETRAINED = {
    "config.json",
    "train_config.json",
    "model.safetensors",
    "policy_preprocessor.json",
    "policy_preprocessor_step_0_normalizer.safetensors",
    "policy_postprocessor.json",
    "policy_postprocessor_step_0_unnormalizer.safetensors",
}
EXPECTED_TRAINING_STATE = {
    "optimizer_param_groups.json",
    "optimizer_state.safetensors",
    "rng_state.safetensors",
    "scheduler_state.json",
    "training_step.json",
}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_short_run_lowers_loss_and_writes_the_guides_checkpoint_tree(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train([*TINY_RUN, "steps=40", "log_freq=10", "checkpoint.save_freq=20", f"output_dir={run_dir}",
                      "optimizer.lr=1e-3"])
    losses = [m["loss"] for m in _metrics(run_dir)]
    assert [m["step"] for m in _metrics(run_dir)] == [10, 20, 30, 40]
    assert losses[-1] < 0.5 * losses[0], losses

    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["000020", "000040", "last"]
    assert (root / "last").is_symlink() and (root / "last").resolve() == (root / "000040").resolve()
    for step in ("000020", "000040"):
        assert {p.name for p in (root / step / "pretrained_model").iterdir()} == EXPECTED_PRETRAINED
        assert {p.name for p in (root / step / "training_state").iterdir()} == EXPECTED_TRAINING_STATE
    info = json.loads((root / "000040" / "training_state" / "training_step.json").read_text())
    assert info["step"] == 40 and info["dp_world_size"] == 1 and info["batch_size"] == 8
    assert info["gradient_accumulation_steps"] == 1 and info["mixed_precision"] == "no"
    assert info["topology"]["layout"] == "single"
    assert info["progress"] == {"step": 40, "samples_seen": 320, "optimizer_updates": 40, "skipped_updates": 0}

    # The banner, train_config.json and the ledger carry the same batch arithmetic.
    assert "batch_size 8 x dp_world_size 1 x grad_accum 1 = effective batch 8" in proc.stdout
    assert "40 loop steps = 320 sample presentations, 40 optimizer updates" in proc.stdout
    saved = json.loads((run_dir / "train_config.json").read_text())
    assert saved["run_arithmetic"]["effective_batch_size"] == 8
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert ledger[0]["kind"] == "start" and ledger[0]["effective_batch_size"] == 8
    intervals = [r for r in ledger if r["kind"] == "interval"]
    assert intervals[-1]["samples_seen"] == 320 and intervals[-1]["optimizer_updates"] == 40
    assert len([r for r in ledger if r["kind"] == "update"]) == 40


def test_gradient_accumulation_counts_updates_and_effective_batch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train([*TINY_RUN, "steps=12", "batch_size=4", "accelerator.gradient_accumulation.steps=3",
                      "log_freq=6", f"output_dir={run_dir}", "checkpoint.save_checkpoint=false"])
    assert "batch_size 4 x dp_world_size 1 x grad_accum 3 = effective batch 12" in proc.stdout
    last = _metrics(run_dir)[-1]
    assert last["samples_seen"] == 48 and last["optimizer_updates"] == 4
    updates = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [u["num_samples"] for u in updates if u["kind"] == "update"] == [12, 12, 12, 12]


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


def test_resume_errors_are_one_clear_line_before_any_training(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_train([*TINY_RUN, "steps=4", f"output_dir={run_dir}"])
    config = run_dir / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    ledger_before = (run_dir / "ledger.jsonl").read_text()

    finished = run_train(["resume=true", f"config_path={config}"], check=False, env={"HYDRA_FULL_ERROR": "0"})
    assert finished.returncode == 2
    assert "lerobot-mg-train: error: steps=4: the checkpoint to resume is already at loop step 4" in finished.stdout
    assert "Traceback" not in finished.stdout

    missing = run_train(["resume=true", f"config_path={tmp_path / 'nope' / 'train_config.json'}"], check=False,
                        env={"HYDRA_FULL_ERROR": "0"})
    assert missing.returncode == 2 and "does not exist" in missing.stdout and "Traceback" not in missing.stdout
    assert (run_dir / "ledger.jsonl").read_text() == ledger_before  # nothing was recorded, nothing lost


def test_an_lr_override_on_resume_takes_effect(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_train([*TINY_RUN, "steps=4", "log_freq=1", f"output_dir={run_dir}"])
    config = run_dir / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    run_train(["resume=true", f"config_path={config}", "steps=6", "optimizer.lr=3e-4", "log_freq=1"])
    lrs = [m["lr"] for m in _metrics(run_dir)]
    assert lrs[:4] == [1e-4] * 4 and lrs[4:] == [3e-4, 3e-4]


def test_dataloader_workers_do_not_change_the_run(tmp_path: Path) -> None:
    from tests.launch_utils import last_weights

    runs = {}
    for workers in (0, 2):
        run_dir = tmp_path / f"workers{workers}"
        run_train([*TINY_RUN, "steps=6", f"num_workers={workers}", f"output_dir={run_dir}"])
        runs[workers] = last_weights(run_dir)
    assert runs[0].keys() == runs[2].keys()
    assert all((runs[0][k] == runs[2][k]).all() for k in runs[0])
