"""Session-wide test set-up."""

from __future__ import annotations

import pytest

from lerobot_mg.sim.backend import configure_headless_rendering, missing_sim_packages


def pytest_configure(config: pytest.Config) -> None:
    # MuJoCo reads MUJOCO_GL once, when it is first imported: choose the headless backend before any test of this
    # worker imports it, whichever test file the worker happens to run first.
    if not missing_sim_packages():
        configure_headless_rendering()
