"""A small ALOHA-shaped dataset with a camera and task instructions, written with lerobot_mg's writer, for the tests
of the VLA presets (experiment=aloha_pi0_tiny, aloha_pi05_tiny, aloha_smolvla_tiny), and the overrides that train
those presets on it in a few seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lerobot_mg.data.writer import LeRobotDatasetWriter
from lerobot_mg.sim.env import IMAGE_KEY, NUM_JOINTS, TASK
from tests.launch_utils import shared_by_workers

VLA_PRESETS = ("aloha_pi0_tiny", "aloha_pi05_tiny", "aloha_smolvla_tiny")
# Two instructions, so that a batch holds different prompts.
TASKS = (TASK, "Put the cube back on the table.")
EPISODE_LENGTH = 12
IMAGE_SHAPE_HWC = (24, 32, 3)
CHUNK = 4
# On the dataset below: chunks that fit its episodes, no evaluation (no simulator), no tracker.
PRESET_TEST_OVERRIDES = [
    f"policy.chunk_size={CHUNK}",
    f"policy.n_action_steps={CHUNK}",
    "eval.n_episodes=0",
    "logging.progress_bar=false",
    "logging.wandb.mode=disabled",
    "log_freq=1",
]


def write_vla_dataset(root: str | Path, seed: int = 0) -> Path:
    """Two episodes of 12 frames: 14 joint positions as state and action, the top camera as H.264 video (smooth
    gradients that move with the frame) and a task per episode (:data:`TASKS`)."""
    rng = np.random.default_rng(seed)
    features = {
        "observation.state": {"dtype": "float32", "shape": [NUM_JOINTS], "names": None},
        "action": {"dtype": "float32", "shape": [NUM_JOINTS], "names": None},
        IMAGE_KEY: {"dtype": "video", "shape": list(IMAGE_SHAPE_HWC), "names": ["height", "width", "channels"]},
    }
    writer = LeRobotDatasetWriter(root, fps=50, features=features, robot_type="aloha")
    height, width, _ = IMAGE_SHAPE_HWC
    y, x = np.mgrid[0:height, 0:width]
    for episode, task in enumerate(TASKS):
        state = rng.normal(size=NUM_JOINTS).astype(np.float32)
        for step in range(EPISODE_LENGTH):
            action = state + 0.1 * rng.normal(size=NUM_JOINTS).astype(np.float32)
            image = np.stack([40 + 4 * x + 8 * step, 40 + 5 * y + 60 * episode, np.full_like(x, 90 + 6 * step)],
                             axis=-1).clip(0, 255).astype(np.uint8)
            writer.add_frame({"observation.state": state, "action": action, IMAGE_KEY: image})
            state = action
        writer.save_episode(task=task)
    writer.finalize()
    return Path(root)


# HuggingFaceVLA/libero's features (the cameras at their size, the state and actions of a Franka arm).
LIBERO_FEATURES = {
    "observation.images.image": {"dtype": "video", "shape": [256, 256, 3], "names": ["height", "width", "channels"]},
    "observation.images.wrist_image": {"dtype": "video", "shape": [256, 256, 3],
                                       "names": ["height", "width", "channels"]},
    "observation.state": {"dtype": "float32", "shape": [8], "names": None},
    "action": {"dtype": "float32", "shape": [7], "names": None},
}


def write_libero_like_dataset(root: str | Path, num_frames: int = 50) -> Path:
    """One episode (as long as pi0.5's action chunk) with LIBERO's features (:data:`LIBERO_FEATURES`) and an
    instruction: what a plan of experiment=pi05_libero reads from the dataset, without downloading it."""
    rng = np.random.default_rng(0)
    writer = LeRobotDatasetWriter(root, fps=10, features=LIBERO_FEATURES, robot_type="panda")
    for step in range(num_frames):
        writer.add_frame({key: np.full(spec["shape"], 4 * step, dtype=np.uint8) if spec["dtype"] == "video"
                          else rng.normal(size=spec["shape"]).astype(np.float32)
                          for key, spec in LIBERO_FEATURES.items()})
    writer.save_episode(task="put both the alphabet soup and the tomato sauce in the basket")
    writer.finalize()
    return Path(root)


def shared_vla_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`write_vla_dataset`'s dataset, written once per test session (whichever xdist worker needs it first)."""
    with shared_by_workers(tmp_path_factory, "vla_presets/dataset") as root:
        if not (root / "meta" / "info.json").is_file():
            write_vla_dataset(root)
        return root
