import json
from pathlib import Path
from typing import Any

import pytest

from lerobot_mg.sim.generate import generate_dataset
from tests.launch_utils import shared_by_workers

NUM_DATASET_EPISODES = 3


def _generated_once(tmp_path_factory: pytest.TempPathFactory, name: str, **arguments: Any) -> tuple[Path, dict]:
    """The dataset and the report of the call that generated it, whichever xdist worker made that call."""
    with shared_by_workers(tmp_path_factory, name) as root:
        report_file = root.with_suffix(".report.json")
        if not report_file.is_file():
            report_file.write_text(json.dumps(generate_dataset(root, **arguments)))
        return root, json.loads(report_file.read_text())


@pytest.fixture(scope="session")
def state_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 3-episode state-only generated dataset (root, generation report), shared by the sim tests."""
    return _generated_once(tmp_path_factory, "sim/aloha_state", num_episodes=NUM_DATASET_EPISODES, seed_start=0)


IMAGE_SIZE = (48, 64)


@pytest.fixture(scope="session")
def image_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 1-episode dataset with the rendered top camera as H.264 video (root, generation report); rendering is the
    slow part, so the sim tests share it."""
    return _generated_once(tmp_path_factory, "sim/aloha_images", num_episodes=1, image_size=IMAGE_SIZE)
