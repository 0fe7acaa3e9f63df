"""The main job's entry points with tiny sizes: train on a generated ALOHA dataset, then evaluate in sim.

`make train` itself (2,000 steps, 50 eval episodes every 500 steps) is too long for CI; this runs the same code
path: scripts/train.py with experiment=aloha_state on the embedded-style dataset, evaluated at its last step, then
scripts/eval.py on the saved checkpoint. Rollouts stop after ``MAX_STEPS`` of the task's 400 steps (``eval.max_steps``,
``--max_steps``): the comparisons need the same rollouts, not whole ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import REPO, clean_env, run_train

pytestmark = pytest.mark.sim

MAX_STEPS = 100


def test_train_then_evaluate_five_episodes(state_dataset: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = state_dataset
    run_dir = tmp_path / "run"
    proc = run_train([
        "experiment=aloha_state", f"dataset.root={root}", f"output_dir={run_dir}", "steps=6", "batch_size=8",
        "log_freq=3", "eval.n_episodes=5", f"eval.max_steps={MAX_STEPS}", "logging.progress_bar=false",
        "logging.wandb.mode=disabled",
        "policy.dim_model=64", "policy.dim_feedforward=128", "policy.n_encoder_layers=1",
    ], timeout=400)
    result = json.loads((run_dir / "eval_info.json").read_text())
    assert result["n_episodes"] == 5 and len(result["per_episode"]) == 5
    assert 0 <= result["num_successes"] <= 5 and result["success_rate"] == result["num_successes"] / 5
    assert all(ep["seed"] >= 100_000 for ep in result["per_episode"])  # held-out seeds only
    assert 0.0 <= result["mean_return"] <= 4 * MAX_STEPS  # a reward of at most 4 per step
    assert all(ep["num_steps"] <= MAX_STEPS for ep in result["per_episode"])
    pretrained = run_dir / "checkpoints" / "last" / "pretrained_model"
    # The last step's evaluation (eval.freq=500 of the preset is past steps=6), in the loop, on the weights saved then.
    assert (f"eval at loop step 6 (48 samples, 6 updates): success rate {result['success_rate']:.2f} "
            f"({result['num_successes']}/5)") in proc.stdout

    # The standalone command on the same checkpoint gives the same rollouts (same seeds, deterministic policy).
    out = tmp_path / "eval.json"
    cmd = [sys.executable, str(REPO / "scripts" / "eval.py"), "--policy_path", str(pretrained), "--n_episodes", "2",
           "--max_steps", str(MAX_STEPS), "--out", str(out)]
    subprocess.run(cmd, env=clean_env(), cwd=REPO, check=True, timeout=300, capture_output=True)
    standalone = json.loads(out.read_text())
    assert [ep["sum_reward"] for ep in standalone["per_episode"]] == [
        ep["sum_reward"] for ep in result["per_episode"][:2]
    ]

    # LoRA on that checkpoint, then the same command on the adapter checkpoint (base + adapter, merged; the unmerged
    # peft model gives the same actions: tests/unit/test_peft.py).
    lora_dir = tmp_path / "lora"
    run_train(["experiment=aloha_state", f"policy.path={pretrained}", "peft=lora", "peft.r=4", f"dataset.root={root}",
               f"output_dir={lora_dir}", "steps=2", "log_freq=1", "eval.n_episodes=0", "logging.progress_bar=false",
               "logging.wandb.mode=disabled"], timeout=400)
    adapter_dir = lora_dir / "checkpoints" / "last" / "pretrained_model"
    assert (adapter_dir / "adapter_model.safetensors").is_file() and not (adapter_dir / "model.safetensors").exists()
    cmd = [sys.executable, str(REPO / "scripts" / "eval.py"), "--policy_path", str(adapter_dir), "--n_episodes", "1",
           "--max_steps", str(MAX_STEPS), "--out", str(out)]
    subprocess.run(cmd, env=clean_env(), cwd=REPO, check=True, timeout=300, capture_output=True)
    assert json.loads(out.read_text())["n_episodes"] == 1


def test_image_preset_trains_on_camera_frames(image_dataset: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = image_dataset
    run_dir = tmp_path / "run"
    proc = run_train([
        "experiment=aloha_image", f"dataset.root={root}", f"output_dir={run_dir}", "steps=2", "batch_size=2",
        "eval.n_episodes=0", "logging.progress_bar=false", "logging.wandb.mode=disabled", "log_freq=1",
        "scheduler.num_warmup_steps=0",
        "policy.dim_model=32", "policy.n_heads=2", "policy.dim_feedforward=64", "policy.vision_channels=[8,16]",
    ], timeout=300)
    config = json.loads((run_dir / "checkpoints" / "last" / "pretrained_model" / "config.json").read_text())
    assert config["input_features"]["observation.images.top"]["type"] == "VISUAL"
    assert config["input_features"]["observation.images.top"]["shape"] == [3, 48, 64]
    assert "aloha_image_act" in proc.stdout
