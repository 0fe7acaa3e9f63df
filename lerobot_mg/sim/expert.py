"""The scripted transfer-cube expert: end-effector waypoints, rolled out, recorded as joint actions.

The recipe is the ACT paper's: the right arm approaches the cube, grasps it and carries it to a
meeting point in the middle; the left arm comes in from the other side, closes on the cube, the
right gripper lets go, and both arms back away. Poses between waypoints are linear in position,
quaternion and gripper opening. The plan is rolled out in the end-effector (mocap) variant of the
scene; the joint positions it visits, with each gripper's joint replaced by its normalised command,
become the actions that the joint-controlled scene replays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lerobot_mg.sim.env import EPISODE_LENGTH, TransferCubeSim

# Where the two grippers meet, in the world frame (metres).
MEET_XYZ = np.array([0.0, 0.5, 0.25])


@dataclass(frozen=True)
class Waypoint:
    step: int
    xyz: np.ndarray
    quat_wxyz: np.ndarray
    gripper: float  # normalised opening: 0 closed, 1 open


@dataclass(frozen=True)
class ExpertDemo:
    joint_actions_TA: np.ndarray  # (EPISODE_LENGTH, 14)


def quat_multiply(a_wxyz: np.ndarray, b_wxyz: np.ndarray) -> np.ndarray:
    aw, ax, ay, az = a_wxyz
    bw, bx, by, bz = b_wxyz
    return np.array(
        [
            aw * bw - ax * bx - ay * by - az * bz,
            aw * bx + ax * bw + ay * bz - az * by,
            aw * by - ax * bz + ay * bw + az * bx,
            aw * bz + ax * by - ay * bx + az * bw,
        ]
    )


def axis_angle_quat(axis: tuple[float, float, float], degrees: float) -> np.ndarray:
    half = math.radians(degrees) / 2
    unit_axis = np.asarray(axis, dtype=float) / np.linalg.norm(axis)
    return np.concatenate([[math.cos(half)], math.sin(half) * unit_axis])


def plan_waypoints(
    cube_xyz: np.ndarray, mocap_left_7: np.ndarray, mocap_right_7: np.ndarray
) -> tuple[list[Waypoint], list[Waypoint]]:
    """(left, right) waypoints of one transfer from the arms' start poses and the cube position."""
    identity = np.array([1.0, 0.0, 0.0, 0.0])
    # The right gripper tilts 60 degrees about y to reach down onto the cube; the left one rolls
    # 90 degrees about x so its fingers close across the cube the right gripper holds.
    pick_quat = quat_multiply(mocap_right_7[3:], axis_angle_quat((0.0, 1.0, 0.0), -60.0))
    receive_quat = axis_angle_quat((1.0, 0.0, 0.0), 90.0)
    left_wait = MEET_XYZ + np.array([-0.1, 0.0, -0.02])
    left_hold = MEET_XYZ + np.array([0.02, 0.0, -0.02])
    grasp = cube_xyz + np.array([0.0, 0.0, -0.015])

    left = [
        Waypoint(0, mocap_left_7[:3], mocap_left_7[3:], 0.0),
        Waypoint(100, left_wait, receive_quat, 1.0),  # open, wait beside the meeting point
        Waypoint(260, left_hold, receive_quat, 1.0),  # slide onto the cube
        Waypoint(310, left_hold, receive_quat, 0.0),  # close on it
        Waypoint(360, left_wait, identity, 0.0),  # pull it away
        Waypoint(EPISODE_LENGTH, left_wait, identity, 0.0),
    ]
    right = [
        Waypoint(0, mocap_right_7[:3], mocap_right_7[3:], 0.0),
        Waypoint(90, cube_xyz + np.array([0.0, 0.0, 0.08]), pick_quat, 1.0),  # above the cube, open
        Waypoint(130, grasp, pick_quat, 1.0),  # down around it
        Waypoint(170, grasp, pick_quat, 0.0),  # grasp
        Waypoint(200, MEET_XYZ + np.array([0.05, 0.0, 0.0]), pick_quat, 0.0),  # lift towards the middle
        Waypoint(220, MEET_XYZ, pick_quat, 0.0),
        Waypoint(310, MEET_XYZ, pick_quat, 1.0),  # let go once the left gripper has closed
        Waypoint(360, MEET_XYZ + np.array([0.1, 0.0, 0.0]), pick_quat, 1.0),  # back away
        Waypoint(EPISODE_LENGTH, MEET_XYZ + np.array([0.1, 0.0, 0.0]), pick_quat, 1.0),
    ]
    return left, right


def interpolate(waypoints: list[Waypoint], step: int) -> np.ndarray:
    """The 8-d arm command (xyz, quat, gripper) at ``step``, linear between the bracketing waypoints."""
    if not waypoints[0].step <= step <= waypoints[-1].step:
        raise ValueError(f"Step {step} is outside the plan [{waypoints[0].step}, {waypoints[-1].step}].")
    later = next(i for i, waypoint in enumerate(waypoints) if waypoint.step > step or i == len(waypoints) - 1)
    start, end = waypoints[max(later - 1, 0)], waypoints[later]
    fraction = 0.0 if end.step == start.step else (step - start.step) / (end.step - start.step)
    xyz = start.xyz + (end.xyz - start.xyz) * fraction
    quat = start.quat_wxyz + (end.quat_wxyz - start.quat_wxyz) * fraction
    gripper = start.gripper + (end.gripper - start.gripper) * fraction
    return np.concatenate([xyz, quat, [gripper]])


def record_expert_demo(seed: int, sim: TransferCubeSim | None = None) -> ExpertDemo:
    """Rolls the scripted expert out in the end-effector scene and returns its joint actions.

    ``sim`` (an end-effector scene) may be passed to reuse one across episodes.
    """
    if sim is None:
        sim = TransferCubeSim(end_effector=True)
    elif not sim.end_effector:
        raise ValueError(
            "record_expert_demo needs an end-effector scene: TransferCubeSim(end_effector=True)."
        )
    from gym_aloha.constants import normalize_puppet_gripper_position  # the sim extra, checked above

    observation = sim.reset(seed)
    cube_pose_7 = observation.cube_pose_7.copy()
    left, right = plan_waypoints(cube_pose_7[:3], observation.mocap_left_7, observation.mocap_right_7)

    joint_actions = []
    for step in range(EPISODE_LENGTH):
        # The joint action for this step is where the expert's arms are now; the gripper entries
        # are the commanded opening, not the measured one, which lags the command.
        joints_14 = observation.qpos_14.copy()
        joints_14[6] = normalize_puppet_gripper_position(observation.gripper_ctrl_4[0])
        joints_14[13] = normalize_puppet_gripper_position(observation.gripper_ctrl_4[2])
        joint_actions.append(joints_14)
        command = np.concatenate([interpolate(left, step), interpolate(right, step)])
        observation, _ = sim.step(command)
    return ExpertDemo(joint_actions_TA=np.stack(joint_actions))
