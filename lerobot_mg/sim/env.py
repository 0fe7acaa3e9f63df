"""ALOHA transfer-cube in MuJoCo, in its two variants: joint-position control and end-effector control.

Both reuse gym_aloha's assets and task code (action mapping, joint readout, the 0..4 reward) and
change three things:

- the cube pose comes from the episode's seed (gym_aloha's end-effector task samples it from the
  global NumPy state, and its joint task reads a module-level global);
- observations hold no images: gym_aloha renders three 480x640 cameras with shadows on every
  step (~0.27 s); :class:`CameraRenderer` renders only the camera that is recorded;
- the end-effector variant strengthens the mocap welds that drag the grippers (see
  ``WELD_TORQUE_SCALE``).

Every sim import happens inside functions, after :func:`require_sim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lerobot_mg.errors import config_error
from lerobot_mg.sim.backend import assert_rendering_available, require_sim

FPS = 50
NUM_JOINTS = 14
MAX_REWARD = 4
EPISODE_LENGTH = 400
CAMERA = "top"
IMAGE_KEY = f"observation.images.{CAMERA}"
# The scene's instruction: every generated demo's task string, and what a policy that reads language (pi0, pi0.5,
# SmolVLA) is told at each step of an evaluation rollout (gym-aloha's wording, as in lerobot/aloha_sim_transfer_cube_*).
TASK = "Pick up the cube with the right arm and transfer it to the left arm."
# Evaluation seeds start here (conf: eval.seed_start), so dataset seeds must stay below it.
HELD_OUT_SEED_START = 100_000
# Largest offscreen buffer the ALOHA scene declares.
MAX_IMAGE_HEIGHT, MAX_IMAGE_WIDTH = 480, 640

# MuJoCo 3.x weld constraints let the grippers lag their mocap targets so far that the original
# ACT recipe transfers the cube in 0-4 of 10 episodes; raising the weld's torque scale (eq_data
# column 10) to 3.75 restores 50/50 (measured on this project's CPU machines).
WELD_TORQUE_SCALE = 3.75
_WELD_TORQUE_SCALE_COLUMN = 10
_CUBE_QPOS_SLICE = slice(16, 23)


def sample_cube_pose(seed: int) -> np.ndarray:
    """Cube (x, y, z, qw, qx, qy, qz) for an episode seed.

    Same ranges and the same draws as gym_aloha's ``sample_box_pose(seed)``, so a seed means the
    same scene here and in gym_aloha's own environment.
    """
    rng = np.random.RandomState(seed)
    low = np.array([0.0, 0.4, 0.05])
    high = np.array([0.2, 0.6, 0.05])
    position = rng.uniform(low, high)
    return np.concatenate([position, [1.0, 0.0, 0.0, 0.0]])


@dataclass(frozen=True)
class SimObservation:
    """What one control step exposes. ``qpos_14``: arm joints + normalised gripper (0 closed, 1 open)."""

    qpos_14: np.ndarray
    cube_pose_7: np.ndarray
    # End-effector variant only (empty arrays otherwise): mocap targets and raw gripper controls.
    mocap_left_7: np.ndarray
    mocap_right_7: np.ndarray
    gripper_ctrl_4: np.ndarray


class TransferCubeSim:
    """One simulated ALOHA scene; ``end_effector=True`` takes 16-d pose actions instead of joints.

    Joint actions (14): per arm 6 joint positions then the normalised gripper opening.
    End-effector actions (16): per arm xyz, quaternion (w, x, y, z), normalised gripper.
    """

    def __init__(self, end_effector: bool = False) -> None:
        require_sim()
        from dm_control import mujoco as dm_mujoco
        from dm_control.rl import control
        from gym_aloha.constants import ASSETS_DIR, DT

        self.end_effector = end_effector
        xml_name = (
            "bimanual_viperx_end_effector_transfer_cube.xml"
            if end_effector
            else "bimanual_viperx_transfer_cube.xml"
        )
        self.physics = dm_mujoco.Physics.from_xml_path(str(ASSETS_DIR / xml_name))
        self._task = _make_task(end_effector)
        self._env = control.Environment(
            self.physics,
            self._task,
            time_limit=float("inf"),
            control_timestep=DT,
            n_sub_steps=None,
            flat_observation=False,
        )

    def reset(self, seed: int) -> SimObservation:
        self._task.cube_pose = sample_cube_pose(seed)
        return self._env.reset().observation["sim"]

    def step(self, action: np.ndarray) -> tuple[SimObservation, int]:
        expected = 16 if self.end_effector else NUM_JOINTS
        if action.shape != (expected,):
            raise ValueError(f"Expected an action of shape ({expected},), got {action.shape}.")
        timestep = self._env.step(action)
        return timestep.observation["sim"], int(timestep.reward)


class CameraRenderer:
    """Renders one camera of a scene, shadows off (the recorded image needs none; ~4x faster)."""

    def __init__(self, sim: TransferCubeSim, height: int, width: int, camera: str = CAMERA) -> None:
        if not (0 < height <= MAX_IMAGE_HEIGHT and 0 < width <= MAX_IMAGE_WIDTH):
            raise config_error(
                "image_size", [height, width], "is outside the scene's offscreen buffer",
                f"image_size=[<height in 1..{MAX_IMAGE_HEIGHT}>,<width in 1..{MAX_IMAGE_WIDTH}>], e.g. [240,320]",
            )
        assert_rendering_available()
        import mujoco

        self._mujoco = mujoco
        self._sim = sim
        self._camera = camera
        self._renderer = mujoco.Renderer(sim.physics.model.ptr, height=height, width=width)

    def render(self) -> np.ndarray:
        """The current frame, HWC uint8."""
        self._renderer.update_scene(self._sim.physics.data.ptr, camera=self._camera)
        self._renderer.scene.flags[self._mujoco.mjtRndFlag.mjRND_SHADOW] = False
        return self._renderer.render().copy()

    def close(self) -> None:
        self._renderer.close()


def _make_task(end_effector: bool) -> Any:
    """Builds the task subclass lazily: its base classes live in the optional sim packages."""
    from dm_control.suite import base
    from gym_aloha.constants import START_ARM_POSE, normalize_puppet_gripper_position
    from gym_aloha.tasks.sim import TransferCubeTask
    from gym_aloha.tasks.sim_end_effector import TransferCubeEndEffectorTask

    def observe(physics: Any, with_mocap: bool) -> dict[str, SimObservation]:
        qpos_raw = physics.data.qpos
        qpos_14 = np.concatenate(
            [
                qpos_raw[:6],
                [normalize_puppet_gripper_position(qpos_raw[6])],
                qpos_raw[8:14],
                [normalize_puppet_gripper_position(qpos_raw[14])],
            ]
        )
        empty = np.zeros(0)
        observation = SimObservation(
            qpos_14=qpos_14,
            cube_pose_7=qpos_raw[_CUBE_QPOS_SLICE].copy(),
            mocap_left_7=np.concatenate([physics.data.mocap_pos[0], physics.data.mocap_quat[0]])
            if with_mocap
            else empty,
            mocap_right_7=np.concatenate([physics.data.mocap_pos[1], physics.data.mocap_quat[1]])
            if with_mocap
            else empty,
            gripper_ctrl_4=physics.data.ctrl.copy() if with_mocap else empty,
        )
        return {"sim": observation}

    class SeededJointTask(TransferCubeTask):
        cube_pose: np.ndarray | None = None

        def initialize_episode(self, physics: Any) -> None:
            assert self.cube_pose is not None, "reset() sets the cube pose before the episode starts"
            with physics.reset_context():
                physics.named.data.qpos[:16] = START_ARM_POSE
                np.copyto(physics.data.ctrl, START_ARM_POSE)
                physics.data.qpos[_CUBE_QPOS_SLICE] = self.cube_pose
            base.Task.initialize_episode(self, physics)

        def get_observation(self, physics: Any) -> dict[str, SimObservation]:
            return observe(physics, with_mocap=False)

    class SeededEndEffectorTask(TransferCubeEndEffectorTask):
        cube_pose: np.ndarray | None = None

        def initialize_episode(self, physics: Any) -> None:
            assert self.cube_pose is not None, "reset() sets the cube pose before the episode starts"
            self.initialize_robots(physics)
            physics.data.qpos[_CUBE_QPOS_SLICE] = self.cube_pose
            physics.model.eq_data[:, _WELD_TORQUE_SCALE_COLUMN] = WELD_TORQUE_SCALE
            base.Task.initialize_episode(self, physics)

        def get_observation(self, physics: Any) -> dict[str, SimObservation]:
            return observe(physics, with_mocap=True)

    return SeededEndEffectorTask() if end_effector else SeededJointTask()
