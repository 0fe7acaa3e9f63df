"""Fault drills: a run that breaks itself on purpose, at a chosen rank and loop step, so tests (and a user who
wants to see what a dead rank does to their cluster) can watch the launcher's reaction without racing a timer.

``LEROBOT_MG_FAULT=<action>@rank<R>:step<N>`` (read here and nowhere else) makes rank ``R`` act during its ``N``-th
loop step, after that step's backward and before its optimizer update: with ``gradient_accumulation.steps > 1`` a
step that does not end an accumulation window is a kill mid-accumulation. The steps count from this process's
start (a resumed process counts from its first step). Actions:

- ``kill``: the rank sends itself SIGKILL (no handler, no cleanup: a machine that loses a process);
- ``raise``: the rank raises :class:`FaultDrillError` (a bug in the middle of training);
- ``sigint`` / ``sigterm``: the rank sends itself SIGINT (Ctrl-C) / SIGTERM (``kill``) and trains on;
- ``sigint_twice``: the rank sends itself SIGINT twice (a user who does not want to wait for the checkpoint);
- ``sigterm_launcher``: the rank sends SIGTERM to its parent, the launcher (torchrun, which forwards it to every
  rank: what ``scancel``, Kubernetes or a time limit does to a job), and waits until the launcher's SIGTERM reached
  it, so the run stops at a step that does not depend on how fast the launcher forwards it.

Before acting, the rank prints one line naming the rank and the step to stderr. ``train()`` builds its stepper with
:func:`stepper_type`: the rank the variable names gets a :class:`DrillStepper`, which runs the drill after each
backward; without the variable, and on every other rank, it is the plain :class:`~lerobot_mg.step.Stepper`, whose
loop step holds no drill code.
"""

from __future__ import annotations

import enum
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from lerobot_mg.step import Stepper

FAULT_ENV = "LEROBOT_MG_FAULT"
_SPEC = re.compile(r"(?P<action>\w+)@rank(?P<rank>\d+):step(?P<step>\d+)")


class FaultAction(enum.Enum):
    KILL = "kill"
    RAISE = "raise"
    SIGINT = "sigint"
    SIGTERM = "sigterm"
    SIGTERM_LAUNCHER = "sigterm_launcher"
    SIGINT_TWICE = "sigint_twice"


class FaultDrillError(RuntimeError):
    """The exception a ``raise`` drill injects: not a user error, so it keeps its traceback."""


_FORWARD_WAIT_S = 60.0


def _signal_launcher_and_wait(signum: signal.Signals) -> None:
    """Send ``signum`` to the parent process and wait until it sends it back here, where it reaches the handler
    that was installed (the run's stop watch) as usual."""
    installed = signal.getsignal(signum)
    arrived: list[bool] = []

    def forward(received: int, frame: object) -> None:
        arrived.append(True)
        if callable(installed):
            installed(received, frame)

    signal.signal(signum, forward)
    try:
        os.kill(os.getppid(), signum)
        deadline = time.monotonic() + _FORWARD_WAIT_S
        while not arrived:
            if time.monotonic() > deadline:
                raise FaultDrillError(f"fault drill: the launcher did not send {signum.name} back in "
                                      f"{_FORWARD_WAIT_S:.0f} s")
            time.sleep(0.01)  # a handler runs in the main thread between two of these
    finally:
        signal.signal(signum, installed)


@dataclass
class FaultDrill:
    action: FaultAction
    rank: int
    step: int  # 1-based loop step of this process
    _steps_seen: int = field(default=0, init=False, repr=False)

    def after_backward(self) -> None:
        """Called once per loop step, between backward and the optimizer update; acts on the drill's step."""
        self._steps_seen += 1
        if self._steps_seen != self.step:
            return
        print(f"fault drill: rank {self.rank} {self.action.value}s at loop step {self.step} ({FAULT_ENV})",
              file=sys.stderr, flush=True)
        if self.action is FaultAction.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action is FaultAction.SIGTERM_LAUNCHER:
            _signal_launcher_and_wait(signal.SIGTERM)
        elif self.action in (FaultAction.SIGINT, FaultAction.SIGTERM):
            os.kill(os.getpid(), signal.SIGINT if self.action is FaultAction.SIGINT else signal.SIGTERM)
        elif self.action is FaultAction.SIGINT_TWICE:
            for _ in range(2):
                signal.raise_signal(signal.SIGINT)  # each reaches the handler before raise_signal returns
        if self.action is not FaultAction.RAISE:
            return
        raise FaultDrillError(f"fault drill: injected failure on rank {self.rank} at loop step {self.step}")


def fault_drill(rank: int) -> FaultDrill | None:
    """The drill ``LEROBOT_MG_FAULT`` asks of this rank, or None (no variable, another rank)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    match = _SPEC.fullmatch(spec.strip())
    if match is None or match["action"] not in {a.value for a in FaultAction}:
        # A typo would silently run the drill-free job the user did not mean to run.
        actions = "|".join(action.value for action in FaultAction)
        raise RuntimeError(f"{FAULT_ENV}={spec!r}: expected <{actions}>@rank<R>:step<N>, e.g. kill@rank1:step5")
    drill = FaultDrill(FaultAction(match["action"]), int(match["rank"]), int(match["step"]))
    return drill if drill.rank == rank else None


class DrillStepper(Stepper):
    """A :class:`~lerobot_mg.step.Stepper` whose every loop step runs ``drill`` after its backward, before the
    optimizer update."""

    def __init__(self, drill: FaultDrill, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drill = drill

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        self.drill.after_backward()


def stepper_type(rank: int) -> Callable[..., Stepper]:
    """What builds this rank's stepper (with :class:`~lerobot_mg.step.Stepper`'s arguments): the plain Stepper, or
    where ``LEROBOT_MG_FAULT`` names this rank, a :class:`DrillStepper` with the drill it asks for."""
    drill = fault_drill(rank)
    return Stepper if drill is None else partial(DrillStepper, drill)
