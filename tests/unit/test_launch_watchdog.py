"""How tests/launch_utils.py watches the processes it launches: a rank that fails ends the launch whichever rank it
is, and a hung launch fails its test with the Python stack of every process, each under a line naming its pid, RANK
and command, so a hang in CI says where each rank waited."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.launch_utils import STACKS_MARK, Output, clean_env, spawn_ranks, watchdog_failure

# A launcher (no RANK) that starts two ranks; each rank prints "ready" from inside the function it then hangs in.
RANK_SCRIPT = """
import sys, time
def rank_waits_for_its_peer():
    print("ready", flush=True)
    time.sleep(3600)
rank_waits_for_its_peer()
"""
LAUNCHER_SCRIPT = """
import os, subprocess, sys
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "RANK": str(r)}) for r in range(2)]
def launcher_waits_for_its_ranks():
    for rank in ranks:
        rank.wait()
launcher_waits_for_its_ranks()
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_hung_launch_fails_with_the_stack_of_each_of_its_processes(tmp_path: Path) -> None:
    output = Output()
    env = clean_env()
    env.pop("RANK", None)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER_SCRIPT, RANK_SCRIPT], env=env, cwd=tmp_path,
                                stdout=output.fd, stderr=subprocess.STDOUT)
    try:
        while output.text().count("ready") < 2:  # both ranks are in the function they hang in
            assert launcher.poll() is None, output.text()
            time.sleep(0.05)
        ranks = [int(pid) for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()]
        error = watchdog_failure("the launch", 1, [launcher], output)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    message = str(error)
    assert message.startswith("watchdog: the launch ran over 1s\n")
    sections = message.split(STACKS_MARK)[1:]
    # The ranks first (RANK from their environment), then the launcher; each section holds its own stack.
    assert [s.split(":", 1)[0].strip() for s in sections] == [
        f"pid {ranks[0]} RANK=0", f"pid {ranks[1]} RANK=1", f"pid {launcher.pid} no RANK"]
    for section in sections[:2]:
        assert 'line 5 in rank_waits_for_its_peer' in section and "launcher_waits" not in section, section
    assert "in launcher_waits_for_its_ranks" in sections[2], sections[2]
    # Nothing is left running, and faulthandler's abort wrote no core file.
    assert not any(_alive(pid) for pid in (*ranks, launcher.pid))
    assert not [name for name in os.listdir(tmp_path) if name.startswith("core")]


def test_a_failing_rank_other_than_the_first_ends_the_launch(tmp_path: Path) -> None:
    """Rank 1 fails while rank 0 waits for it (as a rank waits for a peer's key in a rendezvous): the launch ends
    with rank 1's status at once, rank 0 stopped, instead of running into the watchdog."""
    script = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(3600)\n"
    for stacks in (False, True):
        proc = spawn_ranks([sys.executable, "-c", script], 2, clean_env(), tmp_path, timeout=600,
                           stacks_on_failure=stacks)
        assert proc.returncode == 3, proc.stdout
        assert "spawn_ranks: rank 1 exited 3 (rank 0 running, rank 1 exited 3): stopping the ranks still running" in (
            proc.stdout), proc.stdout
        # With stacks_on_failure, where rank 0 waited (line 4 of the script); else a plain SIGTERM, no stack.
        assert (f"{STACKS_MARK} pid" in proc.stdout and 'line 4 in <module>' in proc.stdout) == stacks, proc.stdout
