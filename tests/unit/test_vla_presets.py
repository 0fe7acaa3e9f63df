"""The runs a user starts with pi0, pi0.5 and SmolVLA on a CPU (experiment=aloha_pi0_tiny, aloha_pi05_tiny,
aloha_smolvla_tiny): their tiny tokenizers ship with the package and are what scripts/make_vla_tiny_assets.py writes;
each preset takes a dataset override, trains a few steps on a dataset with a camera and task instructions, and its
checkpoint runs in a rollout's controller, which hands it the scene's instruction; experiment=pi05_libero (full
size, a Hub dataset) composes and is planned for 8 GPUs without downloading anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import AutoTokenizer

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.loading import CONF_DIR, to_train_config
from lerobot_mg.config.schema import DATA_DIR, TrainConfig, register_configs
from lerobot_mg.sim.env import IMAGE_KEY, NUM_JOINTS, TASK
from lerobot_mg.sim.evaluate import PolicyController
from tests.launch_utils import REPO, interval_metrics, run_train
from tests.vla_preset_aids import (
    IMAGE_SHAPE_HWC,
    PRESET_TEST_OVERRIDES,
    VLA_PRESETS,
    shared_vla_dataset,
    write_libero_like_dataset,
)

TINY_ASSETS = DATA_DIR / "vla_tiny"
TRAIN_STEPS = 3


def composed(overrides: list[str]) -> TrainConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_train_config(compose(config_name="train", overrides=overrides))


@pytest.fixture(scope="module")
def vla_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_vla_dataset(tmp_path_factory)


def test_the_shipped_tiny_assets_are_what_the_script_writes(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "make_vla_tiny_assets.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*") if path.is_file())
    shipped = sorted(path.relative_to(TINY_ASSETS).as_posix() for path in TINY_ASSETS.rglob("*") if path.is_file())
    assert written == shipped == ["paligemma/tokenizer.json", "paligemma/tokenizer_config.json",
                                  "smolvlm/config.json", "smolvlm/tokenizer.json", "smolvlm/tokenizer_config.json"]
    for name in written:
        assert (tmp_path / name).read_bytes() == (TINY_ASSETS / name).read_bytes(), name


@pytest.mark.parametrize("preset", VLA_PRESETS)
def test_a_preset_tokenises_the_scene_instruction_whole_with_its_shipped_tokenizer(preset: str) -> None:
    """From another working directory the preset's tokenizer is the package's folder; the prompt it builds for the
    transfer-cube instruction has no unknown token and fits policy.tokenizer_max_length (pi0.5's prompt holds the
    14 state bins too, the worst case -1 and 255)."""
    policy = composed([f"experiment={preset}"]).policy
    name = policy.vlm_model_name if preset == "aloha_smolvla_tiny" else policy.tokenizer_name
    assert Path(name) == TINY_ASSETS / ("smolvlm" if preset == "aloha_smolvla_tiny" else "paligemma")
    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    prompt = (f"Task: {TASK.lower().rstrip('.')}, State: {' '.join(['-1', '255'] * (NUM_JOINTS // 2))};\nAction: "
              if preset == "aloha_pi05_tiny" else f"{TASK}\n")
    tokens = tokenizer(prompt)["input_ids"]
    assert tokenizer.unk_token_id not in tokens
    assert len(tokens) <= policy.tokenizer_max_length
    assert tokenizer.decode(tokens, skip_special_tokens=True) == prompt


@pytest.fixture(scope="module")
def trained(vla_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each preset trained TRAIN_STEPS steps on the written dataset, given as dataset=lerobot dataset.root=<dir>
    (the override any preset takes), from another working directory; preset -> its run directory."""
    runs = {}
    cwd = tmp_path_factory.mktemp("elsewhere")
    for preset in VLA_PRESETS:
        run_dir = tmp_path_factory.mktemp("vla_presets") / preset
        run_train([f"experiment={preset}", "dataset=lerobot", f"dataset.root={vla_dataset}", f"steps={TRAIN_STEPS}",
                   *PRESET_TEST_OVERRIDES, f"output_dir={run_dir}"], timeout=240, cwd=cwd)
        runs[preset] = run_dir
    return runs


@pytest.mark.parametrize("preset", VLA_PRESETS)
def test_a_preset_trains_on_a_dataset_override_with_a_camera_and_tasks(preset: str, trained: dict[str, Path]) -> None:
    run_dir = trained[preset]
    pretrained = L.checkpoints_root(run_dir) / L.step_dir_name(TRAIN_STEPS) / L.PRETRAINED_MODEL_DIR
    records = interval_metrics(run_dir)
    assert [record["step"] for record in records] == list(range(1, TRAIN_STEPS + 1))
    assert all(np.isfinite(record["loss"]) and record["grad_norm"] > 0 for record in records)
    weights = load_file(str(pretrained / L.MODEL_SAFETENSORS))
    assert weights and all(np.isfinite(tensor.float().numpy()).all() for tensor in weights.values())
    config = json.loads((pretrained / "config.json").read_text())
    assert sorted(config["input_features"]) == ["observation.images.top", "observation.state"]


@pytest.mark.parametrize("preset", VLA_PRESETS)
def test_a_rollout_hands_the_policy_the_scene_instruction(preset: str, trained: dict[str, Path]) -> None:
    """The controller a rollout runs gives the policy its task: the same observation and seed give the same action,
    another instruction another one (the prompt's tokens reach the model)."""
    pretrained = L.checkpoints_root(trained[preset]) / "last" / L.PRETRAINED_MODEL_DIR
    controller = PolicyController.load(pretrained)
    assert controller.task == TASK and controller.image_size == IMAGE_SHAPE_HWC[:2]
    rng = np.random.default_rng(0)
    observation = {"observation.state": rng.normal(size=NUM_JOINTS).astype(np.float32),
                   IMAGE_KEY: rng.integers(0, 256, size=IMAGE_SHAPE_HWC, dtype=np.uint8)}

    def first_action(task: str) -> np.ndarray:
        controller.task = task
        controller.reset(seed=7)
        return controller.act(observation)

    told = first_action(TASK)
    assert told.shape == (NUM_JOINTS,) and np.isfinite(told).all()
    np.testing.assert_array_equal(first_action(TASK), told)
    assert np.abs(first_action("Open the drawer.") - told).max() > 1e-6


def test_pi05_libero_composes_as_the_guide_trains_it() -> None:
    cfg = composed(["experiment=pi05_libero"])
    assert cfg.policy.type == "pi05" and cfg.policy.path == "lerobot/pi05_base"
    assert cfg.policy.dtype == "bfloat16" and cfg.policy.gradient_checkpointing
    assert cfg.dataset.repo_id == "HuggingFaceVLA/libero"
    assert cfg.parallelism.dp_shard == -1 and cfg.accelerator.mixed_precision == "bf16"
    assert cfg.batch_size * 8 == 32 and cfg.eval.n_episodes == 0


def test_pi05_libero_offline_without_the_base_is_refused_in_one_line(tmp_path: Path) -> None:
    """Nothing is downloaded: with an empty Hugging Face cache and HF_HUB_OFFLINE=1 the start names the command
    that fetches the base."""
    proc = run_train(["experiment=pi05_libero", f"output_dir={tmp_path / 'run'}"], check=False, timeout=120,
                     env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
                          "HF_LEROBOT_HOME": str(tmp_path / "lerobot"), "HYDRA_FULL_ERROR": "0"})
    errors = [line for line in proc.stdout.splitlines() if line.startswith("lerobot-mg-train: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stdout[-3000:]
    assert "policy.path='lerobot/pi05_base'" in errors[0] and "hf download lerobot/pi05_base" in errors[0]
    assert "Traceback" not in proc.stdout and not (tmp_path / "run").exists()


def test_pi05_libero_is_planned_for_8_gpus_from_one_process(tmp_path: Path) -> None:
    """The full-size pi0.5 of the preset, planned for 8 ranks on a local dataset with LIBERO's features (the base's
    weights and the Hub dataset are what a real start adds): FSDP2 over 8 shards, the effective batch of 32, the
    27 SigLIP layers as units; nothing is started or written."""
    root = write_libero_like_dataset(tmp_path / "libero_like")
    proc = run_train(["experiment=pi05_libero", "plan=true", "plan_world_size=8", "policy.path=null",
                      f"dataset.root={root}", f"output_dir={tmp_path / 'never_written'}"], timeout=240,
                     env={"HF_HUB_OFFLINE": "1"})
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("memory plan:"))
    assert lines[header] == ("memory plan: FSDP2: 8 shards; batch_size 4 x dp_world_size 8 x grad_accum 1 = "
                             "effective batch 32")
    assert any("(PI05Policy._fsdp_wrap_modules=['SiglipEncoderLayer']): 27" in line for line in lines[header:])
    assert sum(line.startswith("  rank ") for line in lines[header:]) == 8
    assert any(line.startswith(("  fit:", "  does not fit:")) for line in lines[header:])
    assert not (tmp_path / "never_written").exists() and "lerobot_mg train:" not in proc.stdout
