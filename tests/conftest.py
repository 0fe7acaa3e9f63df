"""Session-wide test set-up."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from lerobot_mg.sim.backend import configure_headless_rendering, missing_sim_packages

_SESSION_CACHE: list[str] = []  # the dataset cache this session made, removed at its end


def pytest_configure(config: pytest.Config) -> None:
    # MuJoCo reads MUJOCO_GL once, when it is first imported: choose the headless backend before any test of this
    # worker imports it, whichever test file the worker happens to run first.
    if not missing_sim_packages():
        configure_headless_rendering()
    # The dataset cache goes to a folder of this test session, not the user's ~/.cache/lerobot_mg/datasets-cache:
    # the ranks and commands a test starts inherit it. The embedded datasets ($LEROBOT_MG_CACHE) stay shared.
    if "LEROBOT_MG_DATASET_CACHE" not in os.environ:
        _SESSION_CACHE.append(tempfile.mkdtemp(prefix="lerobot_mg_dataset_cache-"))
        os.environ["LEROBOT_MG_DATASET_CACHE"] = _SESSION_CACHE[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The `sim` tests need the simulation extra: skipped where it is not installed (Python 3.13, where dm_control's
    # labmaze has no wheel), except in CI (CI=true), which installs every extra, so a missing one fails there.
    missing = missing_sim_packages()
    if not missing or os.environ.get("CI") == "true":
        return
    skip = pytest.mark.skip(reason=f"needs the sim extra: {missing} are not installed")
    for item in items:
        if item.get_closest_marker("sim") is not None:
            item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _SESSION_CACHE:
        shutil.rmtree(folder, ignore_errors=True)
