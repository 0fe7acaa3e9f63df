"""A DDP run frees its wrapper before it destroys its process groups, when it finishes and when it stops on a
signal: DDP's C++ reducer must never drop the last reference to a gloo group (that destructor joins gloo's worker
threads under the GIL, and the exit could hang; lerobot_mg/launch/run_state.py)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from lerobot_mg.drills import FAULT_ENV
from tests.dist.conftest import DETERMINISTIC_RUN
from tests.launch_utils import run_train

pytestmark = pytest.mark.dist

PROBE = Path(__file__).with_name("teardown_probe.py")
_PROBE_LINE = re.compile(r"teardown probe: rank (\d) destroys the process groups with (\d+) DDP wrapper")


def _alive_at_destroy(stdout: str) -> dict[int, list[int]]:
    alive: dict[int, list[int]] = {}
    for rank, count in _PROBE_LINE.findall(stdout):
        alive.setdefault(int(rank), []).append(int(count))
    return alive


@pytest.mark.parametrize("stop", [None, "sigint@rank0:step3"], ids=["finished", "stopped_by_sigint"])
def test_ddp_wrapper_is_freed_before_the_process_groups(tmp_path: Path, stop: str | None) -> None:
    proc = run_train([*DETERMINISTIC_RUN, "batch_size=4", "steps=6", f"output_dir={tmp_path / 'run'}"], nproc=2,
                     launcher="torchrun" if stop else None, script=PROBE, timeout=180,
                     env={FAULT_ENV: stop} if stop else None, check=stop is None)
    if stop is not None:
        assert f"exitcode  : {128 + signal.SIGINT}" in proc.stdout, proc.stdout[-4000:]  # torchrun itself exits 1
        assert re.search(r"stopped at loop step \d+ on SIGINT: checkpoint", proc.stdout), proc.stdout[-4000:]
    assert _alive_at_destroy(proc.stdout) == {0: [0], 1: [0]}, proc.stdout[-4000:]
