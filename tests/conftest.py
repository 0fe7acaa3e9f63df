"""`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`): many tests wait on process
start-up, rendezvous and file I/O, so two at a time keep both cores busy.

A worker has its own session, so tests that share a trained run (a session or module fixture) must land on the
same worker, or each worker would train it again. Each module is one group; modules that share session runs are
one group together.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SHARED_RUNS = {
    # layout_run (tests/dist/conftest.py)
    "dist/test_layouts.py": "layout_runs",
    "dist/test_launchers.py": "layout_runs",
    "dist/test_fsdp_options.py": "layout_runs",
    # reference_run (tests/dist/test_checkpoints.py)
    "dist/test_checkpoints.py": "reference_runs",
    "dist/test_resume.py": "reference_runs",
    # state_dataset, image_dataset (tests/sim/conftest.py)
    "sim/test_generate.py": "sim_datasets",
    "sim/test_evaluate.py": "sim_datasets",
    "sim/test_train_then_eval.py": "sim_datasets",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.relative_to(TESTS).as_posix()
        item.add_marker(pytest.mark.xdist_group(SHARED_RUNS.get(module, module)))
