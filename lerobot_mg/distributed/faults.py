"""Fault drills: a run that breaks itself on purpose, at a chosen rank and loop step, so tests (and a user who
wants to see what a dead rank does to their cluster) can watch the launcher's reaction without racing a timer.

``LEROBOT_MG_FAULT=<action>@rank<R>:step<N>`` (read here and nowhere else) makes rank ``R`` act during its ``N``-th
loop step, after that step's backward and before its optimizer update: with ``gradient_accumulation.steps > 1`` a
step that does not end an accumulation window is a kill mid-accumulation. The steps count from this process's
start (a resumed process counts from its first step). Actions:

- ``kill``: the rank sends itself SIGKILL (no handler, no cleanup: a machine that loses a process);
- ``raise``: the rank raises :class:`FaultDrillError` (a bug in the middle of training).

Before acting, the rank prints one line naming the rank and the step to stderr.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import NoReturn

from lerobot_mg.distributed.accelerator import launch_world

FAULT_ENV = "LEROBOT_MG_FAULT"
_SPEC = re.compile(r"(?P<action>\w+)@rank(?P<rank>\d+):step(?P<step>\d+)")


class FaultAction(enum.Enum):
    KILL = "kill"
    RAISE = "raise"


class FaultDrillError(RuntimeError):
    """The exception a ``raise`` drill injects: not a user error, so it keeps its traceback."""


@dataclass
class FaultDrill:
    action: FaultAction
    rank: int
    step: int  # 1-based loop step of this process
    _steps_seen: int = field(default=0, repr=False)

    @classmethod
    def from_env(cls, rank: int) -> FaultDrill | None:
        """The drill ``LEROBOT_MG_FAULT`` asks of this rank, or None."""
        spec = os.environ.get(FAULT_ENV)
        if not spec:
            return None
        match = _SPEC.fullmatch(spec.strip())
        if match is None or match["action"] not in {a.value for a in FaultAction}:
            # A typo would silently run the drill-free job the user did not mean to run.
            raise RuntimeError(f"{FAULT_ENV}={spec!r}: expected <kill|raise>@rank<R>:step<N>, e.g. kill@rank1:step5")
        drill = cls(FaultAction(match["action"]), int(match["rank"]), int(match["step"]))
        return drill if drill.rank == rank else None

    def after_backward(self) -> None:
        """Called once per loop step, between backward and the optimizer update; acts on the drill's step."""
        self._steps_seen += 1
        if self._steps_seen != self.step:
            return
        print(f"fault drill: rank {self.rank} {self.action.value}s at loop step {self.step} ({FAULT_ENV})",
              file=sys.stderr, flush=True)
        if self.action is FaultAction.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        raise FaultDrillError(f"fault drill: injected failure on rank {self.rank} at loop step {self.step}")


# How gloo and NCCL word a collective that failed because a peer process is gone (exited, killed, unreachable).
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited", "NCCL communicator was aborted")
# A rank that lost a peer waits this long for the launcher to stop it (torchrun checks its workers every 0.1 s), so
# the launcher records the rank that failed first as the root cause, not this consequence.
PEER_LOSS_GRACE_S = 5.0


def lost_a_peer(error: BaseException) -> bool:
    """True for a collective that failed because another rank is gone: a consequence, not a cause."""
    return any(marker in str(error) for marker in _PEER_LOSS)


def report_failure(error: BaseException) -> NoReturn:
    """Print the full traceback of a failure that is not a user error, naming the rank that raised it, record it in
    the launcher's error file, and exit with status 1.

    torchrun and ``accelerate launch`` (torch's elastic agent) give every worker an error file
    (``TORCHELASTIC_ERROR_FILE``); what is recorded there becomes the "Root Cause" of the launcher's failure summary,
    with the rank and its traceback. torch's ``@record`` decorator does the same, but only for an exception that
    propagates through it: Hydra's task wrapper catches the exception first and turns it into ``sys.exit(1)``, which
    ``@record`` lets pass unrecorded. So the entry point calls this inside the task function.

    A distributed rank leaves with ``os._exit``: interpreter shutdown runs the destructors of the communication
    objects (DDP's reducer, the gloo/NCCL process group), which can block on peers that are still waiting in a
    collective, and a failed rank that does not exit keeps the whole job waiting for the collective timeout. Its
    exit is what makes the launcher stop the other ranks.
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    world_size, rank, local_rank = launch_world()
    consequence = lost_a_peer(error)
    what = ("lost a peer in a collective (another rank failed or died first; the launcher's root cause names it)"
            if consequence else "failed")
    trace = "".join(traceback.format_exception(error))
    print(f"lerobot-mg-train: rank {rank} of {world_size} (local rank {local_rank} on {socket.gethostname()}, "
          f"pid {os.getpid()}) {what}:\n{trace}", file=sys.stderr, flush=True)
    if consequence:
        time.sleep(PEER_LOSS_GRACE_S)  # the launcher stops this rank (SIGTERM) before this returns
    elif os.environ.get("TORCHELASTIC_ERROR_FILE"):  # set by torch's elastic agent only
        get_error_handler().record_exception(error)
    if world_size == 1:
        raise SystemExit(1)
    logging.shutdown()  # flush the run's log file: os._exit skips that
    sys.stdout.flush()
    os._exit(1)
