"""Launch real training processes from tests: python, torchrun, accelerate launch or spawned ranks, with a watchdog.

Every launch runs with OMP_NUM_THREADS=1, without inherited accelerate variables, and is killed after
``timeout`` seconds so a deadlock fails the test instead of hanging CI.

A multi-process run is started as spawned ranks unless the test is about a launcher: each rank is a process of its
own given the variables torchrun gives its workers (as ``srun`` does under SLURM), which trains exactly as under
torchrun without a launcher process that imports torch for every run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pytest
from filelock import FileLock
from safetensors.torch import load_file

from lerobot_mg.accounting.ledger import read_ledger

REPO = Path(__file__).resolve().parents[1]
# A real third-party LeRobot v3.0 dataset shipped in the package (licence and provenance in its README).
PUSHT_SLICE = REPO / "lerobot_mg" / "data" / "pusht_image_slice"
TRAIN_SCRIPT = REPO / "scripts" / "train.py"
PYTHON = sys.executable

# A small, fast state-only ACT on the real PushT slice (420 frames; the preset's default dataset).
TINY_RUN = [
    "experiment=pusht_debug",
    "logging.progress_bar=false",
    "logging.wandb.mode=disabled",
]


@contextmanager
def shared_by_workers(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A path that every pytest-xdist worker of this session shares (plain pytest: under the session's basetemp),
    held under a lock: the first worker to need a trained run or a generated dataset makes it there, the others
    wait and reuse it instead of training it again."""
    base = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent  # pytest-N/ holds one popen-gwK/ basetemp per worker
    path = base / "shared" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        yield path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "LEROBOT_ALLOW"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1", WANDB_MODE="disabled")
    env.update(extra or {})
    return env


def descendants(pid: int) -> list[int]:
    """Child processes, recursively: torchrun starts each worker in a session of its own, so killing
    torchrun's process group would leave the ranks running."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return [grandchild for child in children for grandchild in (child, *descendants(child))]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process below it (ranks first)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    proc.wait(timeout=30)


def launch_command(nproc: int, launcher: str, script: Path | str = TRAIN_SCRIPT) -> list[str]:
    """The command line that starts ``script`` (a Python file, or a console command) on ``nproc`` processes."""
    if launcher == "python":
        assert nproc == 1
        return [PYTHON, str(script)] if str(script).endswith(".py") else [str(script)]
    if launcher == "torchrun":
        return [PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script)]
    if launcher == "accelerate":
        # --multi_gpu: on a CPU-only host accelerate otherwise starts a single process (on GPU hosts
        # `--num_processes=N` alone picks the multi-process launcher).
        return [PYTHON, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}", "--num_machines=1",
                f"--main_process_port={free_port()}", "--mixed_precision=no", "--dynamo_backend=no",
                str(script)]
    raise ValueError(launcher)


def rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun sets for worker ``rank`` of a one-node job of ``nproc`` processes."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def spawn_ranks(cmd: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Start ``cmd`` as ``nproc`` ranks, their output interleaved in one stream as under torchrun. A rank that fails
    gets the others a SIGTERM, as torchrun does; the exit status is the first failing rank's (0 when all succeed)."""
    port = free_port()
    read_end, write_end = os.pipe()
    try:
        ranks = [subprocess.Popen(cmd, env=rank_env(env, rank, nproc, port), cwd=cwd, stdout=write_end,
                                  stderr=subprocess.STDOUT) for rank in range(nproc)]
    finally:
        os.close(write_end)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_end, 1 << 16), b"")), daemon=True)
    reader.start()

    def first_failure() -> int | None:
        return next((rank.returncode for rank in ranks if rank.returncode), None)

    deadline, failed = time.monotonic() + timeout, None
    try:
        while any(rank.poll() is None for rank in ranks):
            if time.monotonic() > deadline:
                for rank in ranks:
                    kill_tree(rank)
                reader.join(timeout=30)
                out = b"".join(chunks).decode(errors="replace")
                raise AssertionError(f"watchdog: {nproc} ranks of {cmd} ran over {timeout}s\n{out[-6000:]}")
            if failed is None and (failed := first_failure()) is not None:
                for rank in ranks:
                    if rank.poll() is None:
                        rank.terminate()
            time.sleep(0.1)  # torchrun's monitor interval
        reader.join(timeout=30)
    finally:
        os.close(read_end)
    returncode = failed if failed is not None else first_failure() or 0
    return subprocess.CompletedProcess(cmd, returncode, b"".join(chunks).decode(errors="replace"), None)


def run_watched(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end (stdout+stderr in .stdout); past ``timeout`` it and every process below it are killed
    and the test fails with the output."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the watchdog: a hang is a failure with its output
        kill_tree(proc)
        stdout, _ = proc.communicate()
        raise AssertionError(f"watchdog: {cmd} ran over {timeout}s\n{(stdout or '')[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, None)


def run_train(overrides: list[str], nproc: int = 1, launcher: str | None = None, timeout: float = 300,
              env: dict[str, str] | None = None, check: bool = True, cwd: Path | None = None,
              script: Path | str = TRAIN_SCRIPT) -> subprocess.CompletedProcess:
    """Run ``script`` (default scripts/train.py) for real; returns the completed process (stdout+stderr in
    .stdout). ``overrides`` are its arguments. ``launcher``: python (one process), spawn (the default for more),
    torchrun or accelerate."""
    launcher = launcher or ("python" if nproc == 1 else "spawn")
    if launcher == "spawn":
        proc = spawn_ranks([*launch_command(1, "python", script), *overrides], nproc, clean_env(env), cwd or REPO,
                           timeout)
    else:
        proc = run_watched([*launch_command(nproc, launcher, script), *overrides], clean_env(env), cwd or REPO,
                             timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{proc.args} on {nproc} process(es) exited {proc.returncode}\n{proc.stdout[-8000:]}")
    return proc


def last_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "checkpoints" / "last" / "pretrained_model" / "model.safetensors"))


def weights_at(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"{step:06d}" / "pretrained_model" / "model.safetensors"))


def interval_metrics(run_dir: Path) -> list[dict]:
    """The ledger's interval records of the effective run, flat: step and the other counters, wall time since the
    attempt started, and the metrics reduced across ranks (loss, lr, grad_norm, samples/s, ...)."""
    return [{**asdict(r.progress), "wall_time_s": r.wall_time_s, **r.metrics} for r in read_ledger(run_dir).intervals]
