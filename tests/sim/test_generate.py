"""Dataset generation: the reader's round trip, stats, reproducibility, the cache protocol, video."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gym_aloha.constants import START_ARM_POSE

from lerobot_mg.data import LeRobotDataset
from lerobot_mg.errors import ConfigError
from lerobot_mg.sim.cli import make_dataset_main
from lerobot_mg.sim.env import EPISODE_LENGTH, sample_cube_pose
from lerobot_mg.sim.generate import COMPLETE_MARKER, generate_dataset

pytestmark = pytest.mark.sim

REPO_ROOT = Path(__file__).resolve().parents[2]
NUMERIC_KEYS = ("observation.state", "observation.environment_state", "action")


def _columns(dataset: LeRobotDataset) -> dict[str, np.ndarray]:
    items = [dataset[index] for index in range(len(dataset))]
    keys = (*NUMERIC_KEYS, "episode_index", "frame_index", "index")
    return {key: np.stack([item[key].numpy() for item in items]) for key in keys}


def test_generated_dataset_round_trip(state_dataset: tuple[Path, dict]) -> None:
    root, report = state_dataset
    assert report["num_episodes"] == 3 and report["num_frames"] == 3 * EPISODE_LENGTH
    assert report["num_discarded"] == 0 and report["seeds"] == [0, 1, 2] and not report["reused"]

    dataset = LeRobotDataset(root)
    assert dataset.fps == 50 and dataset.num_episodes == 3 and len(dataset) == 3 * EPISODE_LENGTH
    assert dataset.features["observation.state"]["shape"] == [14]
    assert dataset.features["observation.environment_state"]["shape"] == [3]
    assert dataset.features["action"]["shape"] == [14]
    assert dataset[0]["task"] == "Pick up the cube with the right arm and transfer it to the left arm."

    columns = _columns(dataset)
    np.testing.assert_array_equal(columns["episode_index"], np.repeat([0, 1, 2], EPISODE_LENGTH))
    np.testing.assert_array_equal(columns["frame_index"], np.tile(np.arange(EPISODE_LENGTH), 3))
    np.testing.assert_array_equal(columns["index"], np.arange(3 * EPISODE_LENGTH))
    for episode_index, seed in enumerate(report["seeds"]):
        first = episode_index * EPISODE_LENGTH
        # Each episode starts at the arms' home pose with the cube where its seed put it.
        np.testing.assert_allclose(columns["observation.state"][first, :6], START_ARM_POSE[:6], atol=1e-6)
        np.testing.assert_allclose(
            columns["observation.environment_state"][first], sample_cube_pose(seed)[:3], atol=1e-6
        )
    # The cube starts on the table (z = 0.05) and ends lifted, in the left gripper.
    assert columns["observation.environment_state"][EPISODE_LENGTH - 1, 2] > 0.1

    stats = json.loads((root / "meta" / "stats.json").read_text())
    for key in NUMERIC_KEYS:
        values = columns[key].astype(np.float64)
        np.testing.assert_allclose(stats[key]["mean"], values.mean(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats[key]["std"], values.std(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats[key]["min"], values.min(axis=0), atol=1e-6)
        np.testing.assert_allclose(stats[key]["max"], values.max(axis=0), atol=1e-6)
        assert stats[key]["count"] == [3 * EPISODE_LENGTH]


def test_same_seed_same_episode(state_dataset: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = state_dataset
    again = generate_dataset(tmp_path / "again", num_episodes=1, seed_start=1)
    assert again["seeds"] == [1]
    original = _columns(LeRobotDataset(root, episodes=[1]))
    regenerated = _columns(LeRobotDataset(tmp_path / "again"))
    for key in NUMERIC_KEYS:
        np.testing.assert_array_equal(original[key], regenerated[key])


def test_cache_is_reused_and_an_incomplete_directory_regenerated(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first = generate_dataset(root, num_episodes=1)
    assert not first["reused"] and (root / COMPLETE_MARKER).is_file()
    data_file = next((root / "data").rglob("*.parquet"))
    written_at = data_file.stat().st_mtime_ns

    second = generate_dataset(root, num_episodes=1)
    assert second["reused"] and second["seeds"] == first["seeds"]
    assert data_file.stat().st_mtime_ns == written_at

    # No marker: an interrupted run. It is regenerated, not trusted.
    (root / COMPLETE_MARKER).unlink()
    (root / "meta" / "info.json").unlink()
    third = generate_dataset(root, num_episodes=1)
    assert not third["reused"] and (root / COMPLETE_MARKER).is_file()
    assert len(LeRobotDataset(root)) == EPISODE_LENGTH

    with pytest.raises(ConfigError, match="made with .*num_episodes': 1.* not .*num_episodes': 2"):
        generate_dataset(root, num_episodes=2)

    foreign = tmp_path / "not_a_dataset"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"holds \['notes.txt'\].*refusing to delete it"):
        generate_dataset(foreign, num_episodes=1)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_image_dataset_records_the_top_camera(image_dataset: tuple[Path, dict]) -> None:
    root, report = image_dataset
    dataset = LeRobotDataset(root)
    assert dataset.features["observation.images.top"]["dtype"] == "video"
    assert dataset.features["observation.images.top"]["shape"] == [48, 64, 3]
    first = dataset[0]["observation.images.top"]
    last = dataset[EPISODE_LENGTH - 1]["observation.images.top"]
    assert first.shape == (3, 48, 64)
    # A rendered scene: grey table on black, red cube; not a blank frame. The arms move between frames.
    assert 0.05 < float(first.mean()) < 0.9 and float(first.std()) > 0.05
    assert float((first - last).abs().mean()) > 0.01
    stats = json.loads((root / "meta" / "stats.json").read_text())
    assert np.asarray(stats["observation.images.top"]["mean"]).shape == (3, 1, 1)
    assert report["arguments"]["image_size"] == [48, 64]


def test_invalid_arguments_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"seed_start=100000: must be in .*\. Fix: seed_start=0"):
        generate_dataset(tmp_path / "a", num_episodes=1, seed_start=100_000)
    with pytest.raises(ConfigError, match=r"image_size=\(47, 64\): must be \(height, width\) with even sizes"):
        generate_dataset(tmp_path / "b", num_episodes=1, image_size=(47, 64))
    with pytest.raises(ConfigError, match=r"image_size=\[960, 1280\]: is outside the scene's offscreen buffer\. Fix: "):
        generate_dataset(tmp_path / "c", num_episodes=1, image_size=(960, 1280))
    with pytest.raises(ConfigError, match=r"num_episodes=0: must be >= 1\. Fix: num_episodes=50"):
        generate_dataset(tmp_path / "d", num_episodes=0)
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_make_dataset_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert make_dataset_main([f"root={tmp_path / 'cli'}", "num_episodes=1", "seed_start=3"]) == 0
    assert "1 episodes, 400 frames (generated in" in capsys.readouterr().out
    # LeRobot's spelling is the same command.
    assert make_dataset_main([f"--root={tmp_path / 'cli'}", "--num_episodes=1", "--seed_start=3"]) == 0
    assert "(reused); 0 failed demos discarded" in capsys.readouterr().out
    assert make_dataset_main([f"root={tmp_path / 'cli'}", "num_episodes=2"]) == 2
    assert "lerobot-mg-make-dataset: error: " in (err := capsys.readouterr().err)
    assert "already holds a generated dataset" in err


def test_package_imports_without_the_sim_extra(tmp_path: Path) -> None:
    # Blocking the modules makes their import fail as if they were not installed.
    code = (
        "import sys\n"
        "for name in ('mujoco', 'dm_control', 'gym_aloha'): sys.modules[name] = None\n"
        "import lerobot_mg.sim\n"
        "import lerobot_mg.sim.generate\n"
        "try:\n"
        f"    lerobot_mg.sim.generate.generate_dataset({str(tmp_path / 'x')!r}, 1)\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'lerobot_mg[sim]'" in result.stdout
    assert "['mujoco', 'dm_control', 'gym_aloha']" in result.stdout
