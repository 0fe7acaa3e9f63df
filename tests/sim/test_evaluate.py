"""Evaluation rollouts: a saved (untrained) policy end to end, input checks, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest

from lerobot_mg.data import LeRobotDataset
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies import make_policy
from lerobot_mg.policies.act import ACTConfig
from lerobot_mg.policies.diffusion import DiffusionConfig
from lerobot_mg.processors import make_processors
from lerobot_mg.sim import HELD_OUT_SEED_START, evaluate_policy
from lerobot_mg.sim.cli import eval_main
from lerobot_mg.sim.env import TransferCubeSim
from lerobot_mg.sim.evaluate import ExpertController, PolicyController, policy_inputs, run_evaluation

pytestmark = pytest.mark.sim

MAX_STEPS = 60


def save_untrained_policy(
    directory: Path, dataset_features: dict, stats: dict, config: ACTConfig | DiffusionConfig | None = None
) -> None:
    config = config or ACTConfig(
        chunk_size=10,
        n_action_steps=10,
        dim_model=32,
        n_heads=4,
        dim_feedforward=64,
        n_encoder_layers=1,
        n_decoder_layers=1,
        latent_dim=8,
        n_vae_encoder_layers=1,
    )
    policy = make_policy(config, dataset_features)
    preprocessor, postprocessor = make_processors(
        config, policy.input_features, policy.output_features, stats
    )
    policy.save_pretrained(directory)
    preprocessor.save_pretrained(directory)
    postprocessor.save_pretrained(directory)


def test_rollout_observations_match_the_dataset(state_dataset: tuple[Path, dict]) -> None:
    """A policy sees in simulation exactly what it was trained on: same keys, values, dtypes."""
    root, report = state_dataset
    dataset = LeRobotDataset(root, episodes=[2])
    seed = report["seeds"][2]
    sim = TransferCubeSim()
    expert = ExpertController()
    expert.reset(seed)
    observation = sim.reset(seed)
    for step in range(3):
        inputs = policy_inputs(observation)
        frame = dataset[step]
        for key, value in inputs.items():
            assert value.dtype == np.float32
            np.testing.assert_array_equal(value, frame[key].numpy())
        action = expert.act(inputs)
        np.testing.assert_allclose(action, frame["action"].numpy(), atol=1e-6)
        observation, _ = sim.step(action)


def test_evaluate_untrained_policy(state_dataset: tuple[Path, dict], tmp_path: Path) -> None:
    root, report = state_dataset
    dataset = LeRobotDataset(root)
    pretrained = tmp_path / "pretrained_model"
    save_untrained_policy(pretrained, dataset.features, dataset.stats)

    result = evaluate_policy(
        pretrained,
        n_episodes=2,
        seed_start=HELD_OUT_SEED_START,
        video_dir=tmp_path / "videos",
        max_steps=MAX_STEPS,
    )
    assert set(result) >= {"success_rate", "num_successes", "n_episodes", "mean_return", "per_episode"}
    assert result["n_episodes"] == 2 and len(result["per_episode"]) == 2
    held_out = [episode["seed"] for episode in result["per_episode"]]
    assert held_out == [HELD_OUT_SEED_START, HELD_OUT_SEED_START + 1]
    assert not set(held_out) & set(report["seeds"])
    assert result["num_successes"] == sum(episode["success"] for episode in result["per_episode"])
    assert 0.0 <= result["success_rate"] <= 1.0
    assert result["success_rate"] == result["num_successes"] / 2
    for episode in result["per_episode"]:
        assert 1 <= episode["num_steps"] <= MAX_STEPS
        assert 0 <= episode["max_reward"] <= 4
        assert 0 <= episode["sum_reward"] <= 4 * episode["num_steps"]
    mean_return = sum(episode["sum_reward"] for episode in result["per_episode"]) / 2
    assert result["mean_return"] == pytest.approx(mean_return)

    # Videos of the first episodes (3 by default, so both here): every step plus the final state.
    assert len(result["videos"]) == 2
    for video, episode in zip(result["videos"], result["per_episode"]):
        with av.open(video) as container:
            num_frames = sum(1 for _ in container.decode(video=0))
        assert num_frames == episode["num_steps"] + 1


def test_diffusion_rolls_out_on_its_observation_history(state_dataset: tuple[Path, dict], tmp_path: Path) -> None:
    """Diffusion Policy in the loop: each prediction sees the last n_obs_steps observations (as in training) and
    feeds n_action_steps actions."""
    root, _ = state_dataset
    dataset = LeRobotDataset(root)
    config = DiffusionConfig(horizon=8, n_action_steps=4, down_dims=[16, 32], diffusion_step_embed_dim=16,
                             noise_scheduler_type="DDIM", num_inference_steps=2)
    save_untrained_policy(tmp_path, dataset.features, dataset.stats, config)
    controller = PolicyController.load(tmp_path)
    shapes: list[tuple[int, ...]] = []
    predict = controller.policy.predict_action_chunk

    def recording_predict(batch: dict) -> object:
        shapes.append(tuple(batch["observation.state"].shape))
        return predict(batch)

    controller.policy.predict_action_chunk = recording_predict  # type: ignore[method-assign]
    result = run_evaluation(controller, n_episodes=1, seed_start=HELD_OUT_SEED_START, max_steps=10)
    num_steps = result["per_episode"][0]["num_steps"]
    assert shapes == [(1, 2, 14)] * -(-num_steps // 4)


def test_policy_with_inputs_the_simulation_lacks_is_rejected(tmp_path: Path) -> None:
    features = {
        "observation.state": {"dtype": "float32", "shape": [14]},
        "observation.images.wrist": {
            "dtype": "video",
            "shape": [32, 32, 3],
            "names": ["height", "width", "channels"],
        },
        "action": {"dtype": "float32", "shape": [14]},
    }
    stats = {key: {"mean": [0.0] * 14, "std": [1.0] * 14} for key in ("observation.state", "action")} | {
        "observation.images.wrist": {"mean": [[[0.5]]] * 3, "std": [[[0.2]]] * 3}
    }
    save_untrained_policy(tmp_path, features, stats)
    with pytest.raises(ConfigError, match=r"reads \['observation.images.wrist'\], which the transfer-cube"):
        evaluate_policy(tmp_path, n_episodes=1, seed_start=HELD_OUT_SEED_START)
    with pytest.raises(ConfigError, match=r"policy_path='.*missing': is not a directory\. Fix: policy_path="):
        evaluate_policy(tmp_path / "missing", n_episodes=1, seed_start=HELD_OUT_SEED_START)


def test_eval_command_on_the_expert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert eval_main(["expert=true", "n_episodes=2", f"--out={out}"]) == 0
    printed = capsys.readouterr().out
    assert "success 2/2 (100.0%)" in printed and "seeds 100000..100001" in printed
    report = json.loads(out.read_text())
    assert report["num_successes"] == 2 and report["videos"] == []
    assert eval_main([f"--policy_path={tmp_path / 'missing'}", "--n_episodes=1"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert eval_main(["n_episodes=1"]) == 2
    assert "lerobot-mg-eval: error: policy_path=None expert=False: give exactly one of policy_path=" in (
        capsys.readouterr().err)


def test_image_policy_watches_the_rendered_camera(tmp_path: Path) -> None:
    features = {
        "observation.state": {"dtype": "float32", "shape": [14]},
        "observation.images.top": {
            "dtype": "video",
            "shape": [48, 64, 3],
            "names": ["height", "width", "channels"],
        },
        "action": {"dtype": "float32", "shape": [14]},
    }
    stats = {key: {"mean": [0.0] * 14, "std": [1.0] * 14} for key in ("observation.state", "action")} | {
        "observation.images.top": {"mean": [[[0.3]]] * 3, "std": [[[0.2]]] * 3}
    }
    save_untrained_policy(tmp_path / "pretrained_model", features, stats)
    result = evaluate_policy(
        tmp_path / "pretrained_model",
        n_episodes=1,
        seed_start=HELD_OUT_SEED_START,
        video_dir=tmp_path / "videos",
        max_steps=5,
    )
    assert result["per_episode"][0]["num_steps"] == 5
    # The video shows what the policy saw: frames at the policy's image size.
    with av.open(result["videos"][0]) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 6 and frames[0].shape == (48, 64, 3)
    assert 10 < frames[0].mean() < 200
