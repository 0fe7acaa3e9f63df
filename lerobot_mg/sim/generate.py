"""Scripted transfer-cube demonstrations written as a LeRobot v3.0 dataset, generated once and cached.

Each episode uses its own seed (``seed_start``, ``seed_start + 1``, ...): the seed fixes the cube
pose and the simulation is deterministic, so the same call writes the same dataset. Seeds whose
replay fails to transfer the cube are discarded and the next seed is tried, so the dataset holds
exactly ``num_episodes`` successful demonstrations.

Cache protocol: ``generation_complete.json`` is written after the dataset is finalized. A
directory with it is reused (when it was made with the same arguments); a directory without it is
an interrupted generation and is regenerated.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from lerobot_mg.data.writer import LeRobotDatasetWriter
from lerobot_mg.errors import config_error
from lerobot_mg.sim.env import (
    EPISODE_LENGTH,
    FPS,
    HELD_OUT_SEED_START,
    IMAGE_KEY,
    MAX_REWARD,
    NUM_JOINTS,
    TASK,
    CameraRenderer,
    TransferCubeSim,
)
from lerobot_mg.sim.expert import record_expert_demo

ROBOT_TYPE = "aloha"
COMPLETE_MARKER = "generation_complete.json"
JOINT_NAMES = [
    f"{side}_{joint}"
    for side in ("left", "right")
    for joint in ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper")
]
# Only what a LeRobotDatasetWriter creates may be deleted when an interrupted generation restarts.
_DATASET_ENTRIES = {"meta", "data", "videos"}


def dataset_features(image_size: tuple[int, int] | None) -> dict[str, dict[str, Any]]:
    features: dict[str, dict[str, Any]] = {
        "observation.state": {"dtype": "float32", "shape": [NUM_JOINTS], "names": JOINT_NAMES},
        "observation.environment_state": {
            "dtype": "float32",
            "shape": [3],
            "names": ["cube_x", "cube_y", "cube_z"],
        },
        "action": {"dtype": "float32", "shape": [NUM_JOINTS], "names": JOINT_NAMES},
    }
    if image_size is not None:
        height, width = image_size
        features[IMAGE_KEY] = {
            "dtype": "video",
            "shape": [height, width, 3],
            "names": ["height", "width", "channels"],
        }
    return features


def generate_dataset(
    root: Path,
    num_episodes: int,
    seed_start: int = 0,
    image_size: tuple[int, int] | None = None,
    video_codec: str = "h264",
) -> dict[str, Any]:
    """Writes ``num_episodes`` successful scripted demos under ``root`` (or reuses a complete one).

    ``image_size=(height, width)`` adds the ``observation.images.top`` video. Returns the
    generation report: ``num_episodes``, ``num_frames``, ``num_discarded``, ``seeds`` (kept),
    ``discarded_seeds``, ``seconds_per_episode``, ``reused`` and the arguments.
    """
    root = Path(root)
    _validate_arguments(num_episodes, seed_start, image_size, video_codec)
    arguments = {
        "num_episodes": num_episodes,
        "seed_start": seed_start,
        "image_size": list(image_size) if image_size is not None else None,
        # Without images no video is written, so the codec does not distinguish two datasets.
        "video_codec": video_codec if image_size is not None else None,
    }
    marker = root / COMPLETE_MARKER
    if marker.is_file():
        report = json.loads(marker.read_text())
        if report["arguments"] != arguments:
            raise config_error(
                "root", str(root), f"already holds a generated dataset made with {report['arguments']}, not "
                f"{arguments}", f"another root, or delete {root} to regenerate it",
            )
        return {**report, "reused": True}
    _remove_incomplete(root)

    expert_sim = TransferCubeSim(end_effector=True)
    replay_sim = TransferCubeSim()
    # Built before the writer so that a size the scene cannot render fails before anything is written.
    renderer = CameraRenderer(replay_sim, *image_size) if image_size is not None else None
    writer = LeRobotDatasetWriter(
        root, fps=FPS, features=dataset_features(image_size), robot_type=ROBOT_TYPE, video_codec=video_codec
    )
    started = time.perf_counter()
    try:
        kept_seeds, discarded_seeds = _record_episodes(
            writer, expert_sim, replay_sim, renderer, num_episodes, seed_start
        )
    finally:
        if renderer is not None:
            renderer.close()
    writer.finalize()
    seconds = time.perf_counter() - started
    report = {
        "arguments": arguments,
        "num_episodes": len(kept_seeds),
        "num_frames": len(kept_seeds) * EPISODE_LENGTH,
        "num_discarded": len(discarded_seeds),
        "seeds": kept_seeds,
        "discarded_seeds": discarded_seeds,
        "seconds": round(seconds, 3),
        "seconds_per_episode": round(seconds / (len(kept_seeds) + len(discarded_seeds)), 3),
    }
    # Written last: its presence is what makes the directory a complete, reusable dataset.
    marker.write_text(json.dumps(report, indent=2) + "\n")
    return {**report, "reused": False}


def _record_episodes(
    writer: LeRobotDatasetWriter,
    expert_sim: TransferCubeSim,
    replay_sim: TransferCubeSim,
    renderer: CameraRenderer | None,
    num_episodes: int,
    seed_start: int,
) -> tuple[list[int], list[int]]:
    """Saves successful demos seed after seed until ``num_episodes`` are kept; returns (kept, discarded)."""
    kept_seeds: list[int] = []
    discarded_seeds: list[int] = []
    # A seed fails rarely (0 of 50 measured); this bound only stops a broken simulation from looping.
    max_discarded = max(10, num_episodes)
    seed = seed_start
    with tqdm(total=num_episodes, desc="scripted demos", unit="episode") as progress:
        while len(kept_seeds) < num_episodes:
            if seed >= HELD_OUT_SEED_START:
                raise RuntimeError(
                    f"Generation reached seed {seed}, where held-out evaluation seeds start; "
                    f"{len(discarded_seeds)} seeds failed. Use a smaller seed_start."
                )
            demo = record_expert_demo(seed, expert_sim)
            columns, max_reward = _replay(replay_sim, seed, demo.joint_actions_TA, renderer=None)
            if max_reward == MAX_REWARD:
                if renderer is not None:
                    images, _ = _replay(replay_sim, seed, demo.joint_actions_TA, renderer=renderer)
                    columns = {**columns, **images}
                columns["action"] = demo.joint_actions_TA.astype(np.float32)
                for step in range(EPISODE_LENGTH):
                    writer.add_frame({key: values[step] for key, values in columns.items()})
                writer.save_episode(task=TASK)
                kept_seeds.append(seed)
                progress.update(1)
            else:
                discarded_seeds.append(seed)
                progress.set_postfix(discarded=len(discarded_seeds))
                if len(discarded_seeds) > max_discarded:
                    raise RuntimeError(
                        f"The scripted expert failed on {len(discarded_seeds)} seeds ({discarded_seeds}) while "
                        f"keeping {len(kept_seeds)}; the simulation does not behave as expected "
                        "(check the mujoco and gym-aloha versions)."
                    )
            seed += 1
    return kept_seeds, discarded_seeds


def _replay(
    sim: TransferCubeSim, seed: int, joint_actions_TA: np.ndarray, renderer: CameraRenderer | None
) -> tuple[dict[str, np.ndarray], int]:
    """Replays joint actions from the seed's start; returns per-step observations and the max reward.

    Without a renderer: state and cube position before each action. With one: only the images
    (the replay is deterministic, so a second pass renders exactly the states of the first).
    """
    observation = sim.reset(seed)
    states, cube_positions, images = [], [], []
    max_reward = 0
    for action in joint_actions_TA:
        if renderer is None:
            states.append(observation.qpos_14.astype(np.float32))
            cube_positions.append(observation.cube_pose_7[:3].astype(np.float32))
        else:
            images.append(renderer.render())
        observation, reward = sim.step(action)
        max_reward = max(max_reward, reward)
    if renderer is not None:
        return {IMAGE_KEY: np.stack(images)}, max_reward
    return {
        "observation.state": np.stack(states),
        "observation.environment_state": np.stack(cube_positions),
    }, max_reward


def _validate_arguments(
    num_episodes: int, seed_start: int, image_size: tuple[int, int] | None, video_codec: str
) -> None:
    if num_episodes < 1:
        raise config_error("num_episodes", num_episodes, "must be >= 1", "num_episodes=50")
    if not 0 <= seed_start < HELD_OUT_SEED_START:
        raise config_error(
            "seed_start", seed_start, f"must be in [0, {HELD_OUT_SEED_START}): seeds from {HELD_OUT_SEED_START} on "
            "are held out for evaluation", "seed_start=0",
        )
    if image_size is not None and (len(image_size) != 2 or any(size % 2 for size in image_size)):
        raise config_error(
            "image_size", image_size, "must be (height, width) with even sizes (the video is yuv420p)",
            "image_size=[240,320]",
        )
    if video_codec not in ("h264", "av1"):
        raise config_error("video_codec", video_codec, "is not supported", "video_codec=h264 (or av1)")


def _remove_incomplete(root: Path) -> None:
    """Deletes an interrupted generation; refuses to touch a directory that holds anything else."""
    if not root.exists():
        return
    if not root.is_dir():
        raise config_error("root", str(root), "exists and is not a directory", "root=<a new or empty directory>")
    foreign = sorted(entry.name for entry in root.iterdir() if entry.name not in _DATASET_ENTRIES)
    if foreign:
        raise config_error(
            "root", str(root), f"has no {COMPLETE_MARKER} but holds {foreign}, which a dataset generation does not "
            "write; refusing to delete it", "root=<a new or empty directory>",
        )
    shutil.rmtree(root)
