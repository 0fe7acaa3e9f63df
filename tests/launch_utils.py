"""Launch real training processes from tests: python, torchrun, accelerate launch or spawned ranks, with a watchdog.

Every launch runs with OMP_NUM_THREADS=1, without inherited accelerate variables, and is killed after
``timeout`` seconds so a deadlock fails the test instead of hanging CI. Before killing a hung launch the watchdog
has each of its processes print where its Python threads were (:func:`dump_stacks`), so a hang names the line every
rank waited on.

A multi-process run is started as spawned ranks unless the test is about a launcher: each rank is a process of its
own given the variables torchrun gives its workers (as ``srun`` does under SLURM), which trains exactly as under
torchrun without a launcher process that imports torch for every run.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
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


def _ports_of_this_worker() -> range:
    """The ports this pytest worker's rendezvous stores take: below the kernel's ephemeral range, which every
    outgoing connection (gloo's own pairs among them) draws from, so a port found free is not handed to a socket of
    another test before the store binds it; one slice per xdist worker, so that two workers never pick the same."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    first, width = 10_000, 1_000
    start = first + (index % max((low - first) // width, 1)) * width
    return range(start, min(start + width, low))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a launch's rendezvous (MASTER_PORT)."""
    ports = list(_ports_of_this_worker())
    random.Random().shuffle(ports)  # its own generator: a test that seeds the global one picks no fixed port
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every port of the slice taken: any free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "LEROBOT_ALLOW"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    # PYTHONFAULTHANDLER: a process that crashes (or that the watchdog aborts, see dump_stacks) prints the Python
    # stack of each of its threads.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1", WANDB_MODE="disabled",
               PYTHONFAULTHANDLER="1")
    env.update(extra or {})
    return env


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (none once it has exited: a process can end while it is being listed)."""
    children: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    for task in tasks:
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return children


def descendants(pid: int) -> list[int]:
    """Child processes, recursively: torchrun starts each worker in a session of its own, so killing
    torchrun's process group would leave the ranks running."""
    return [grandchild for child in _children(pid) for grandchild in (child, *descendants(child))]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process below it (ranks first)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    proc.wait(timeout=30)


class Output:
    """The stdout and stderr of the processes a launch starts, merged in one pipe as a launcher's terminal shows
    them, read by a thread as they come. The launch helpers write their own lines into the same stream."""

    def __init__(self) -> None:
        self._read_fd, self.fd = os.pipe()
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := os.read(self._read_fd, 1 << 16):
            self._chunks.append(chunk)

    def note(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> str:
        """Everything written, once the launched processes are gone (they hold the pipe's other copies)."""
        os.close(self.fd)
        self._reader.join(timeout=30)
        os.close(self._read_fd)
        return self.text()

    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")


STACKS_MARK = "launch: Python stacks of"
STACK_DUMP_WAIT_S = 10.0


def _describe(pid: int) -> str:
    """``pid 123 RANK=2: python facts.py ...``: the process, its rank (from its environment) and its command."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    rank = next((v.decode() for v in environ if v.startswith(b"RANK=")), "no RANK")
    command = " ".join(b" ".join(argv).decode(errors="replace").split())  # one line, even for python -c
    return f"pid {pid} {rank}: {command[:300]}"


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def dump_stacks(procs: list[subprocess.Popen], output: Output) -> None:
    """Where every thread of hung processes was: each of ``procs`` (and each process these started: torchrun's
    workers) prints its threads' Python stacks into ``output``, one process after the other, and dies; whatever else
    runs below them is killed.

    The whole tree is frozen first (SIGSTOP), so no process reacts to another's end before its own stack is taken.
    Then each gets SIGABRT and SIGCONT: faulthandler (``PYTHONFAULTHANDLER``, set by :func:`clean_env`) prints its
    stacks and re-raises the signal, with core dumps off for that process.
    """
    tree = [pid for proc in procs for pid in (proc.pid, *descendants(proc.pid))]
    shown = [pid for proc in procs for pid in (*_children(proc.pid), proc.pid)]  # a launcher after its workers
    for pid in tree:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
    for pid in shown:
        if _gone(pid):
            continue
        output.note(f"\n{STACKS_MARK} {_describe(pid)}\n")
        with contextlib.suppress(OSError):  # no core file (if the limit cannot be set, the system's applies)
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
        try:
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    for pid in tree:  # the rest (data loader workers, ...): orphaned by now, and still frozen
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    for proc in procs:
        proc.wait(timeout=30)


def watchdog_failure(what: str, timeout: float, procs: list[subprocess.Popen], output: Output) -> AssertionError:
    """Past ``timeout``: dump every process's stacks, kill the tree, and the error that fails the test with the
    launch's last output and the stacks."""
    dump_stacks(procs, output)
    text = output.close()
    cut = text.find(f"\n{STACKS_MARK}")
    before, stacks = (text, "") if cut < 0 else (text[:cut], text[cut:])
    return AssertionError(f"watchdog: {what} ran over {timeout}s\n{before[-6000:]}\n{stacks[-30000:]}")


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


def spawn_ranks(cmd: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float,
                stacks_on_failure: bool = True) -> subprocess.CompletedProcess:
    """Start ``cmd`` as ``nproc`` ranks, their output interleaved in one stream as under torchrun. Every rank is
    watched: when one fails, a line in the output says which and what each of the others was doing, and the ranks
    still running are stopped, as torchrun does: with SIGTERM, or, with ``stacks_on_failure`` (for a launch whose
    failure fails the test anyway), after printing where their threads were (:func:`dump_stacks`). The exit status
    is the first failing rank's (0 when all succeed)."""
    port = free_port()
    output = Output()
    ranks = [subprocess.Popen(cmd, env=rank_env(env, rank, nproc, port), cwd=cwd, stdout=output.fd,
                              stderr=subprocess.STDOUT) for rank in range(nproc)]
    deadline, failed = time.monotonic() + timeout, None
    while None in (codes := [rank.poll() for rank in ranks]):  # every rank, every tick
        if time.monotonic() > deadline:
            raise watchdog_failure(f"{nproc} ranks of {cmd}", timeout, ranks, output)
        if failed is None and (failed := next((code for code in codes if code), None)) is not None:
            states = ", ".join(f"rank {r} {'running' if code is None else f'exited {code}'}"
                               for r, code in enumerate(codes))
            output.note(f"\nspawn_ranks: rank {codes.index(failed)} exited {failed} ({states}): stopping the "
                        "ranks still running\n")
            running = [rank for rank, code in zip(ranks, codes) if code is None]
            if stacks_on_failure:
                dump_stacks(running, output)
            for rank in running:
                rank.terminate()
        time.sleep(0.1)  # torchrun's monitor interval
    if failed is None:
        failed = next((code for code in codes if code), 0)
    return subprocess.CompletedProcess(cmd, failed, output.close(), None)


def run_watched(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end (stdout+stderr in .stdout); past ``timeout`` the stacks of it and of every process it
    started are printed, they are killed and the test fails with the output."""
    output = Output()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=output.fd, stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # the watchdog: a hang is a failure with its output and its stacks
        raise watchdog_failure(str(cmd), timeout, [proc], output) from None
    text = output.close().replace("\r\n", "\n").replace("\r", "\n")  # as a text-mode pipe reads it
    return subprocess.CompletedProcess(cmd, proc.returncode, text, None)


def run_train(overrides: list[str], nproc: int = 1, launcher: str | None = None, timeout: float = 300,
              env: dict[str, str] | None = None, check: bool = True, cwd: Path | None = None,
              script: Path | str = TRAIN_SCRIPT) -> subprocess.CompletedProcess:
    """Run ``script`` (default scripts/train.py) for real; returns the completed process (stdout+stderr in
    .stdout). ``overrides`` are its arguments. ``launcher``: python (one process), spawn (the default for more),
    torchrun or accelerate."""
    launcher = launcher or ("python" if nproc == 1 else "spawn")
    if launcher == "spawn":
        proc = spawn_ranks([*launch_command(1, "python", script), *overrides], nproc, clean_env(env), cwd or REPO,
                           timeout, stacks_on_failure=check)
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
    attempt started, and the metrics reduced across ranks (loss, lr, grad_norm, samples_per_s, ...)."""
    return [{**asdict(r.progress), "wall_time_s": r.wall_time_s, **r.metrics} for r in read_ledger(run_dir).intervals]
