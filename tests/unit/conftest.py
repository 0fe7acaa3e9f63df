import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.data_aids import TinyDataset, write_tiny_dataset


@pytest.fixture
def tiny_dataset(tmp_path: Path) -> TinyDataset:
    """A 3-episode dataset (state, action, env state, a PNG image and an h264 video feature)
    written with our writer, with the values it wrote."""
    return write_tiny_dataset(tmp_path / "tiny")


@pytest.fixture
def tiny_dataset_dir(tiny_dataset: TinyDataset) -> Path:
    return tiny_dataset.root


@pytest.fixture(autouse=True)
def restored_environ() -> Iterator[None]:
    """Each test starts from the environment the session started with: an Accelerator built in this process writes
    ACCELERATE_* variables, which the start-up checks of a later test would take for the user's."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
