"""Stopping a run on a signal without losing work: Ctrl-C (SIGINT), SIGTERM, and SLURM preemption under submitit.

A signal handler may not communicate or block, and a rank that stops alone leaves its peers waiting in a collective.
So each rank only records the signal, the ranks agree on it at an accumulation boundary, every rank writes a
normal, blocking checkpoint there, and only then does the run leave:

- SIGINT and SIGTERM (Ctrl-C; ``kill``; what torchrun forwards to its workers when it gets either; Kubernetes,
  ``scancel``, ``scontrol requeue``, SLURM's time limit and its preemption): the main process prints ``stopped at
  loop step N on SIGTERM: checkpoint <dir>; resume with: <command>`` and every rank exits with status 128 + the
  signal's number. Nothing requeues the job here: under SLURM it comes back only if SLURM requeues it itself
  (``PreemptMode=REQUEUE``, ``scontrol requeue``), and then resumes from ``checkpoints/last`` by itself. Under
  submitit this replaces submitit's own SIGTERM handler, which only logs the signal.
- A second SIGINT or SIGTERM stops the process at once, without a checkpoint: the first one puts back the default
  action of both (SIG_DFL), so the second is handled by the kernel, not by Python, and ends a rank even while it
  is blocked in a collective or a long write (where a Python handler would wait for that call to return). A rank
  already blocked when the first signal comes cannot run this handler before the call returns either.
- submitit's preemption signal (USR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` names another; SLURM sends it
  ``--signal=USR2@<s>`` before the time limit, and at a preemption with ``PreemptParameters=send_user_signal``)
  reaches every SLURM task, but only global rank 0 runs submitit's handler, which re-pickles the submission, calls
  ``scontrol requeue`` and exits on the spot: a collective save inside it would deadlock. So the handler runs only
  after the checkpoint (rank 0 requeues, the others exit 0). The requeued job starts ``train()`` again with the
  original arguments and resumes from ``checkpoints/last`` by itself (:mod:`lerobot_mg.launch.sweep`);
  :data:`PREEMPTION_RECORD` tells it why it stopped. When the ranks agree to stop and the preemption signal
  reached any of them, with or without a SIGTERM around it, the job is requeued: the preemption signal is the one
  that asks for it.

The ledger gets a ``stop`` record with the cause. How the ranks agree without stalling the device: see
:meth:`PreemptionWatch.agreed`.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from lerobot_mg.accounting.ledger import RunLedger, StopRecord
from lerobot_mg.checkpoint import layout as L
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.run_facts import Progress, ResumeCause

logger = logging.getLogger(__name__)

PREEMPTION_RECORD = "preemption.json"
_PREEMPT_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"  # submitit's own variable: it installs its handler on this signal
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The command line that launched a SLURM sweep, as JSON: a SLURM task's own command line is submitit's.
LAUNCH_COMMAND_ENV = "LEROBOT_MG_LAUNCH_COMMAND"
_INSTALLED: weakref.WeakSet[PreemptionWatch] = weakref.WeakSet()  # watches whose handlers are in place


@dataclass(frozen=True)
class PreemptionRecord:
    """Why and where the last attempt stopped; written by the main process after the preemption checkpoint."""

    signal: str
    loop_step: int
    time: float
    slurm_job_id: str | None


def preemption_signal() -> signal.Signals:
    return signal.Signals["SIG" + os.environ.get(_PREEMPT_SIGNAL_ENV, "USR2")]


def _submitit_will_requeue(handler: object) -> bool:
    from submitit.core.job_environment import SignalHandler

    return isinstance(getattr(handler, "__self__", None), SignalHandler)


def uninstall_watches() -> None:
    """Put back the signal handlers of every watch still installed in this process (a run that raised)."""
    for watch in list(_INSTALLED):
        watch.uninstall()


class PreemptionWatch:
    """Records SIGINT, SIGTERM and submitit's preemption signal on this rank, and tells all ranks, together, when
    to stop (:meth:`agreed`) and how (:meth:`leave`).

    The preemption signal is watched only where submitit installed its requeue handler on it (the same on every rank
    of a job). Constructing the watch is collective in a distributed run (it creates a small gloo group for the flag).
    """

    def __init__(self, dims: ParallelDims, accumulation_steps: int, group_timeout: timedelta | None = None):
        self.dims, self.accumulation_steps = dims, accumulation_steps
        self.signum = preemption_signal()
        self.received_at: float | None = None  # the preemption signal
        self.stop_signal: signal.Signals | None = None  # the first SIGINT/SIGTERM
        self._previous: dict[int, object] = {}
        self._submitit_handler = signal.getsignal(self.signum)
        self.active = _submitit_will_requeue(self._submitit_handler)
        self.cause: signal.Signals | None = None  # what the ranks agreed to stop for
        self._leaving = False  # the stop is under way: a signal that arrives late changes nothing
        if threading.current_thread() is threading.main_thread():  # only the main thread may install handlers
            for signum in {*STOP_SIGNALS, *([self.signum] if self.active else [])}:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._record)
            _INSTALLED.add(self)
        # A host-side group: the flag's all-reduce never waits for the device (see agreed()).
        self._group = dist.new_group(backend="gloo", timeout=group_timeout) if dims.is_distributed else None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def _record(self, signum: int, frame: object) -> None:
        # A handler only sets a flag: nothing here may block or communicate.
        if self._leaving:
            return
        if self.active and signum == self.signum:
            if self.received_at is None:
                self.received_at = time.time()
            return
        if self.stop_signal is not None:  # a stop signal recorded since a drill put this handler back: no wait
            os.write(2, f"\n{signal.Signals(signum).name} again: stopping now, without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.stop_signal = signal.Signals(signum)
        # The next SIGINT/SIGTERM is the kernel's to handle: it ends the process even inside a call that never
        # returns to Python (a collective waiting for a lost peer, a long write), where this handler could not run.
        for stop in STOP_SIGNALS:
            if stop in self._previous:
                signal.signal(stop, signal.SIG_DFL)
        if self.dims.is_main_process:
            os.write(2, f"\n{self.stop_signal.name} received: saving a checkpoint at the next optimizer update, then "
                        "stopping (send it again to stop at once, without one)\n".encode())

    def uninstall(self) -> None:
        """Put back the handlers the watch replaced (submitit's, or the defaults), also where a first stop signal
        left the default action."""
        for signum, previous in self._previous.items():
            current = signal.getsignal(signum)
            if getattr(current, "__self__", None) is self or (self.stop_signal is not None and current == signal.SIG_DFL):
                signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous = {}
        _INSTALLED.discard(self)

    def finish(self) -> None:
        """After the last loop step: wait for the flag exchange still in flight (every rank started it), so the
        process groups are idle when they are destroyed. Collective in effect: every rank calls it."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def _flags(self) -> torch.Tensor:
        return torch.tensor([self.received_at is not None, 0 if self.stop_signal is None else int(self.stop_signal)],
                            dtype=torch.int32)

    def _exchange(self) -> tuple[dist.Work, torch.Tensor]:
        """Start reducing this rank's flags with every other rank's (MAX over the host-side group)."""
        flags = self._flags()
        return dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flags

    def agreed(self, loop_step: int) -> bool:
        """True on every rank once any rank has received a signal, at accumulation boundaries only (gradients inside
        a window are not checkpointed); :attr:`cause` names the signal. Collective: every rank must call it after
        every loop step.

        No device synchronisation: the flags are host memory, reduced over a gloo group of their own, and the
        all-reduce started at one boundary is read at the next (it has long finished by then): the ranks agree one
        accumulation boundary after the signal reached the last of them. In one process the flag is read at once.

        Whether to stop comes from the exchange of the previous boundary; why (:attr:`cause`) from the latest flags:
        once every rank knows it stops, each waits for the exchange it just started, so a signal that arrived since
        (the SIGTERM after a preemption signal, or the other way round) counts. The preemption signal wins over
        SIGINT/SIGTERM: it is the one that asks for a requeue."""
        if loop_step % self.accumulation_steps:
            return False
        if self._group is None:
            decided = self._flags()
        else:
            previous = self._pending
            if previous is not None:
                previous[0].wait()
            self._pending = self._exchange()
            if previous is None or not previous[1].numpy().any():  # host memory: no device read
                return False
            # Every rank saw a signal in the previous exchange, so every rank waits here for the latest one.
            work, decided = self._pending
            work.wait()
            self._pending = None
        preempted, stop = (int(x) for x in decided.numpy())  # a host tensor: nothing waits for the device
        if not (preempted or stop):
            return False
        self.cause = self.signum if preempted else signal.Signals(stop)
        if self.dims.is_main_process:
            logger.warning("%s received: saving a checkpoint at loop step %d, then %s.", self.cause.name, loop_step,
                           "the job is requeued" if preempted else "the run stops")
        return True

    def leave(self, output_dir: Path, progress: Progress, saved: bool, rerun: list[str]) -> NoReturn:
        """After the checkpoint of this loop step is complete on disk (``saved``; false when checkpoints are off):
        record the stop in the ledger and leave. Does not return. ``rerun``: the arguments that resume this run
        after a stop (see :func:`resume_command`). Collective: no rank leaves before the main process has
        recorded the stop (under ``srun --kill-on-bad-exit`` a rank that exits first gets the others killed)."""
        self.finish()
        step_dir = L.checkpoints_root(output_dir) / L.step_dir_name(progress.step)
        assert self.cause is not None, "leave() before agreed() returned True"
        self._leaving = True
        requeue = self.cause == self.signum
        if self.dims.is_main_process:
            ledger = RunLedger(output_dir, True)
            ledger.write(StopRecord(time.time(), replace(progress), self.cause.name,
                                    str(step_dir) if saved else None, requeued=requeue))
            ledger.close()
            if requeue:
                record = PreemptionRecord(self.signum.name, progress.step, time.time(), os.environ.get("SLURM_JOB_ID"))
                (Path(output_dir) / PREEMPTION_RECORD).write_text(json.dumps(asdict(record)) + "\n")
            else:
                where = f"checkpoint {step_dir}" if saved else "no checkpoint (checkpoint.save_checkpoint=false)"
                print(f"stopped at loop step {progress.step} on {self.cause.name}: {where}; resume with: "
                      f"{shlex.join(rerun)}", flush=True)
        if self._group is not None:  # the other ranks wait here until the main process has written the above
            self._exchange()[0].wait()
        if requeue:
            self.uninstall()
            self._requeue(progress.step)
        raise SystemExit(128 + int(self.cause))

    def _requeue(self, loop_step: int) -> NoReturn:
        # submitit's handler: rank 0 re-pickles the submission, runs `scontrol requeue` and exits; other ranks return.
        self._submitit_handler(self.signum, None)  # type: ignore[operator]
        # Exit status 0: with srun --kill-on-bad-exit, a failing rank would get rank 0 killed before it requeues.
        print(f"rank {self.dims.rank}: stopped at loop step {loop_step} for {self.signum.name}; the job is requeued "
              "and resumes from checkpoints/last", flush=True)
        raise SystemExit(0)


def _launcher_argv() -> list[str]:
    """The command line that started this run: torchrun's (or ``accelerate launch``'s) for one of its workers; the
    sweep's command for a SLURM job (:data:`LAUNCH_COMMAND_ENV`, set by the SLURM launcher in each task)."""
    if os.environ.get(LAUNCH_COMMAND_ENV):
        return list(json.loads(os.environ[LAUNCH_COMMAND_ENV]))
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a worker of torch's elastic agent: its parent is the launcher
        try:
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
            return [part.decode() for part in raw.split(b"\0") if part]
        except OSError:
            pass
    return list(sys.orig_argv)


def resume_command(output_dir: Path, step: int, sweep_dir: Path | None) -> list[str]:
    """The command that resumes this run from its checkpoint of ``step``: the launcher's command line up to the
    training script, then ``resume=true config_path=...``. A sweep point is resumed by running its sweep again
    into the same sweep directory (every point resumes its own ``checkpoints/last``)."""
    argv = _launcher_argv()
    script = sys.argv[0]
    if sweep_dir is not None:
        return [*(part for part in argv if not part.startswith("hydra.sweep.dir=")), f"hydra.sweep.dir={sweep_dir}"]
    position = next((i for i, part in enumerate(argv) if part == script), None)
    prefix = argv[: position + 1] if position is not None else [sys.executable, script]
    if len(prefix) > 1 and not prefix[1].startswith("-") and not prefix[1].endswith(".py"):
        prefix = prefix[1:]  # `python /venv/bin/torchrun ...`: the console script is what the user typed
    config = L.checkpoints_root(output_dir) / L.step_dir_name(step) / L.PRETRAINED_MODEL_DIR / L.TRAIN_CONFIG_JSON
    return [*prefix, "resume=true", f"config_path={config}"]


def read_preemption_record(output_dir: Path) -> PreemptionRecord | None:
    path = Path(output_dir) / PREEMPTION_RECORD
    if not path.is_file():
        return None
    return PreemptionRecord(**json.loads(path.read_text()))


def resume_cause(output_dir: Path, resumed_step: int) -> ResumeCause:
    """Why a run directory that already holds checkpoints is being started again."""
    record = read_preemption_record(output_dir)
    if record is not None and record.loop_step == resumed_step:
        return ResumeCause.PREEMPTION
    if int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:  # SLURM requeued it (node failure, scontrol requeue)
        return ResumeCause.REQUEUE
    return ResumeCause.RELAUNCH
