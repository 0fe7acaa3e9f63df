"""The scripted expert and the seeded scene: poses from seeds, waypoint interpolation, success rate."""

from __future__ import annotations

import numpy as np
import pytest

from lerobot_mg.sim.env import EPISODE_LENGTH, TransferCubeSim, sample_cube_pose
from lerobot_mg.sim.evaluate import evaluate_expert
from lerobot_mg.sim.expert import Waypoint, axis_angle_quat, interpolate, quat_multiply, record_expert_demo

pytestmark = pytest.mark.sim


def test_cube_pose_comes_from_the_seed_like_gym_aloha() -> None:
    from gym_aloha.utils import sample_box_pose

    for seed in (0, 7, 100_000):
        np.testing.assert_array_equal(sample_cube_pose(seed), sample_box_pose(seed))
    assert not np.allclose(sample_cube_pose(0)[:2], sample_cube_pose(1)[:2])
    sim = TransferCubeSim()
    np.testing.assert_allclose(sim.reset(3).cube_pose_7, sample_cube_pose(3))
    np.testing.assert_allclose(sim.reset(3).cube_pose_7, sim.reset(3).cube_pose_7)


def test_interpolation_is_linear_between_waypoints() -> None:
    waypoints = [
        Waypoint(0, np.zeros(3), np.array([1.0, 0.0, 0.0, 0.0]), 0.0),
        Waypoint(10, np.array([1.0, 2.0, 3.0]), np.array([0.0, 1.0, 0.0, 0.0]), 1.0),
        Waypoint(20, np.array([1.0, 2.0, 3.0]), np.array([0.0, 1.0, 0.0, 0.0]), 0.0),
    ]
    np.testing.assert_allclose(interpolate(waypoints, 0), [0, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(interpolate(waypoints, 5), [0.5, 1.0, 1.5, 0.5, 0.5, 0, 0, 0.5])
    np.testing.assert_allclose(interpolate(waypoints, 10), [1, 2, 3, 0, 1, 0, 0, 1])
    np.testing.assert_allclose(interpolate(waypoints, 15)[-1], 0.5)
    with pytest.raises(ValueError, match="outside the plan"):
        interpolate(waypoints, 21)


def test_quaternions_compose_rotations() -> None:
    quarter_turn_z = axis_angle_quat((0.0, 0.0, 1.0), 90.0)
    np.testing.assert_allclose(quarter_turn_z, [np.sqrt(0.5), 0, 0, np.sqrt(0.5)])
    np.testing.assert_allclose(quat_multiply(quarter_turn_z, quarter_turn_z), [0, 0, 0, 1], atol=1e-12)


def test_expert_demo_is_reproducible_and_joint_shaped() -> None:
    sim = TransferCubeSim(end_effector=True)
    first = record_expert_demo(5, sim)
    again = record_expert_demo(5, sim)
    assert first.joint_actions_TA.shape == (EPISODE_LENGTH, 14)
    np.testing.assert_array_equal(first.joint_actions_TA, again.joint_actions_TA)
    # Grippers start closed (0); the right one opens linearly until the step-90 waypoint. Action t
    # holds the gripper command issued at step t - 1.
    assert first.joint_actions_TA[0, 13] == pytest.approx(0.0, abs=1e-6)
    assert first.joint_actions_TA[46, 13] == pytest.approx(0.5, abs=1e-6)
    assert first.joint_actions_TA[91, 13] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="end-effector scene"):
        record_expert_demo(5, TransferCubeSim())


def test_expert_transfers_the_cube_on_at_least_9_of_10_seeds() -> None:
    report = evaluate_expert(n_episodes=10, seed_start=0)
    assert report["n_episodes"] == 10
    assert report["num_successes"] >= 9, report["per_episode"]
    assert [episode["seed"] for episode in report["per_episode"]] == list(range(10))
    for episode in report["per_episode"]:
        if episode["success"]:
            # The episode ends at the first step the left gripper holds the cube off the table.
            assert episode["max_reward"] == 4 and episode["num_steps"] < EPISODE_LENGTH
