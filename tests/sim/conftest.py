from pathlib import Path

import pytest

from lerobot_mg.sim import generate_dataset

NUM_DATASET_EPISODES = 3


@pytest.fixture(scope="session")
def state_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 3-episode state-only generated dataset (root, generation report), shared by the sim tests."""
    root = tmp_path_factory.mktemp("sim") / "aloha_state"
    return root, generate_dataset(root, NUM_DATASET_EPISODES, seed_start=0)


IMAGE_SIZE = (48, 64)


@pytest.fixture(scope="session")
def image_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 1-episode dataset with the rendered top camera as H.264 video (root, generation report); rendering is the
    slow part, so the sim tests share it."""
    root = tmp_path_factory.mktemp("sim") / "aloha_images"
    return root, generate_dataset(root, num_episodes=1, image_size=IMAGE_SIZE)
